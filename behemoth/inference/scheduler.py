"""Iteration-level scheduling over the paged KV cache (continuous batching, Orca / vLLM style).

Each `step()` the scheduler: drops aborted requests (their blocks go back at once); admits waiting
requests while the running batch has room and the cache has blocks for their prompts; runs one prefill
forward for the newcomers and one decode forward for the others, so every running request gets one
token per step; and retires finished requests, freeing their blocks, so the next step can admit more.
When the cache cannot give a running request its next block, the request admitted last is preempted:
its blocks are freed and it waits again at the head of the queue, to be prefilled anew with its
tokens so far (recomputation, as vLLM does), which changes none of its tokens. With `prefix_caching`, a newcomer
starts on the cached blocks of its longest cached prefix and prefills only the rest (prefix_cache.py).
With `kv_offload`, a preempted request's keys and values are copied to host memory and written back into new blocks
when it is admitted again, so only its last token is computed anew (under tensor or pipeline parallelism every rank
copies its own heads and layers: this scheduler, on job rank 0, sends each move with the steps, runner.KVMove).
With `prefill_chunk`, a step prefills at most that many prompt tokens (Sarathi / vLLM chunked prefill): a long prompt
is prefilled over several steps, each also decoding every running request, so running streams keep getting a token
per step while it is admitted; its first token is drawn when its last chunk is in the cache. Where the runner packs rows
(`kv_cache.plan_packed_step`), the chunk and the decodes are one forward (a mixed step: the weights are read once, so the
chunk rides on the decode's cost). With `prefill_chunk="auto"` the chunk is chosen at every step from step times
measured at start on the served model (step_budget.py): the largest whose mixed step stays within `step_factor` x a
decode-only step of the running batch.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from behemoth.errors import BehemothError
from behemoth.inference.kv_cache import BlockAllocator, plan_packed_step, plan_step
from behemoth.inference.prefix_cache import PrefixCachingAllocator
from behemoth.inference.runner import KVMove, Runner
from behemoth.inference.sampling import SamplingParams, TokenChoice, choose_tokens, request_generator
from behemoth.inference.step_budget import Observed, StepBudget, check_factor, measure_step_costs
from behemoth.inference.text import TextTracker, Tokenizer


class QueueFull(BehemothError):
    """The waiting queue is at its bound: the caller should come back later (HTTP 429)."""


@dataclass(frozen=True)
class Event:
    """What a request's consumer is told after a step: new tokens and text, and the finish reason once it ends."""

    request_id: int
    token: int | None
    text: str
    finish_reason: str | None = None  # "stop", "length", "abort"
    choice: TokenChoice | None = None  # the token's log-probability and the most likely alternatives


@dataclass(eq=False)
class Request:
    """One generation: its prompt, parameters, tokens so far, and where its events go. Requests compare by identity (the
    scheduler's `r in self.running` then costs a pointer test per row, not a comparison of every field)."""

    id: int
    prompt: list[int]
    params: SamplingParams
    tracker: TextTracker
    sink: Callable[[Event], None] | None = None
    output: list[int] = field(default_factory=list)
    choices: list[TokenChoice] = field(default_factory=list)  # one per output token
    cached: int = 0  # tokens whose keys and values are in the cache
    prefilled: bool = False  # its prompt (and tokens so far, after a preemption) is in the cache: it decodes
    offloaded: dict[str, Any] | None = None  # its keys and values in host memory while preempted (kv_offload)
    finish_reason: str | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    generator: torch.Generator | None = None
    epoch: int = 0  # preemptions so far: its keys and values since the last one (decode lanes tell them apart)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def text(self) -> str:
        return self.tracker.text


@dataclass(frozen=True)
class SchedulerPolicy:
    """Limits of one scheduler: running batch, waiting queue, tokens per sequence, and continuous or static batching."""

    max_batch: int = 32
    max_waiting: int = 256
    max_prefill_tokens: int = 4096  # prompt tokens admitted into one prefill forward
    context: int = 1024  # positions a sequence may occupy (the model's context)
    policy: Literal["continuous", "static"] = "continuous"
    prefix_caching: bool = False  # share full KV blocks of equal prefixes between requests (prefix_cache.py)
    prefill_chunk: int | Literal["auto"] | None = None  # prompt tokens prefilled per step at most (None: whole prompts;
    # "auto": measured at start, the largest chunk whose step is within step_factor x a decode-only step, step_budget.py)
    step_factor: float = 1.5  # with prefill_chunk="auto": a mixed step's time at most this times a decode-only step's
    kv_offload: bool = False  # a preempted request's KV blocks go to host memory and come back, instead of recomputation

    def __post_init__(self) -> None:
        chunk = self.prefill_chunk
        if chunk is not None and chunk != "auto" and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise BehemothError(f"a prefill chunk of {chunk!r} tokens", "use --prefill-chunk 1 or more (e.g. 256) or auto, or leave it unset")
        check_factor(self.step_factor)


class Speculative(Protocol):
    """A decode step that may give a request several tokens (speculative.py's SpeculativeDecoder)."""

    def decode(self, sched: Scheduler, rows: list[Request]) -> list[Request]: ...

    def release(self, request_id: int) -> None: ...


class Scheduler:
    """Requests in, one token per running request per step out, blocks taken and given back as they go."""

    def __init__(
        self,
        runner: Runner,
        alloc: BlockAllocator,
        policy: SchedulerPolicy,
        tokenizer: Tokenizer | None = None,
        speculative: Speculative | None = None,
        budget: StepBudget | None = None,
    ) -> None:
        """`budget`: with prefill_chunk="auto", step costs already measured (None: measure them now, step_budget.py)."""
        if policy.prefix_caching and not isinstance(alloc, PrefixCachingAllocator):
            alloc = PrefixCachingAllocator(alloc.num_blocks, alloc.block_size)
        self.runner, self.alloc, self.policy, self.tokenizer = runner, alloc, policy, tokenizer
        self.speculative = speculative  # a draft model proposes, the target checks (speculative.py)
        self.prefixes = alloc if isinstance(alloc, PrefixCachingAllocator) else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.aborts: set[int] = set()
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.stats = {"steps": 0, "prefill_tokens": 0, "decode_tokens": 0, "preemptions": 0, "finished": 0, "aborted": 0, "prefix_hit_tokens": 0}
        if speculative is not None:
            self.stats.update(draft_tokens=0, accepted_tokens=0)
        self.packs = bool(getattr(runner, "packs_rows", False)) and policy.prefill_chunk is not None and speculative is None
        self.budget = (budget or self._measure_budget()) if policy.prefill_chunk == "auto" else None
        if policy.prefill_chunk is not None:
            self.stats.update(mixed_steps=0)  # steps whose one forward held a prompt's chunk and the decodes
        if policy.kv_offload:
            if not hasattr(runner, "move_kv"):
                raise BehemothError(f"KV offload with a {type(runner).__name__}: it has no host copies of its cache", "drop --kv-offload")
            self.stats.update(offloaded_tokens=0, restored_tokens=0)  # tokens a draft proposed, and those the target kept

    def _measure_budget(self) -> StepBudget:
        """`prefill_chunk="auto"`: time the served model's steps now, before any request (step_budget.py)."""
        p = self.policy
        if not self.packs:
            why = "a draft model's decode steps" if self.speculative is not None else f"a {type(self.runner).__name__}"
            raise BehemothError(f"--prefill-chunk auto with {why}: its prompt chunks and decodes cannot share one forward", "use --prefill-chunk N")
        alloc, rows = self.alloc, min(4, p.max_batch)
        costs = measure_step_costs(
            self.runner.forward, alloc.num_blocks, alloc.block_size, context=p.context, rows=rows, max_rows=p.max_batch, factor=p.step_factor
        )
        return StepBudget(costs, p.step_factor, p.max_prefill_tokens, Observed(costs.clock))

    def chunk_limit(self, decoding: int, prefix: int) -> int | None:
        """Prompt tokens this step may prefill, with `decoding` requests decoding and the next prompt `prefix` tokens in
        (None: whole prompts, up to max_prefill_tokens)."""
        chunk = self.policy.prefill_chunk
        if self.budget is not None:
            return self.budget.chunk(decoding, prefix)
        return None if chunk == "auto" else chunk

    def submit(self, prompt: list[int], params: SamplingParams, sink: Callable[[Event], None] | None = None) -> Request:
        """Queue a request (thread-safe); QueueFull when the waiting queue is at its bound."""
        if len(prompt) + params.max_tokens > self.policy.context:
            raise BehemothError(
                f"a prompt of {len(prompt)} tokens plus max_tokens={params.max_tokens} exceeds the context of {self.policy.context}",
                f"ask for at most {max(0, self.policy.context - len(prompt))} tokens",
            )
        blocks = -(-(len(prompt) + params.max_tokens) // self.alloc.block_size)
        if blocks > self.alloc.num_blocks:  # it could never finish, even alone (preemption would cycle)
            raise BehemothError(
                f"a prompt of {len(prompt)} tokens with max_tokens={params.max_tokens} needs {blocks} KV-cache blocks, "
                f"the cache has {self.alloc.num_blocks}",
                "give the cache more memory or ask for fewer tokens",
            )
        req = Request(
            next(self.ids),
            list(prompt),
            params,
            TextTracker(self.tokenizer, params.stop, prompt),
            sink,
            generator=None if params.greedy else request_generator(params.seed),
        )
        with self.lock:
            if len(self.waiting) >= self.policy.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are waiting, the bound is {self.policy.max_waiting}", "retry later")
            self.waiting.append(req)
        return req

    def abort(self, request_id: int) -> None:
        """Stop a request at the next step and free its blocks (thread-safe; a client disconnected)."""
        with self.lock:
            self.aborts.add(request_id)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting and not self.aborts

    def step(self) -> list[Request]:
        """One iteration: abort, admit, prefill newcomers (a chunk of them), decode the rest, retire. The requests that
        finished."""
        finished = self._drop_aborted()
        self._admit()
        decoding = self._make_room([r for r in self.running if r.prefilled])
        prefilling = [r for r in self.running if not r.prefilled]
        prefix = prefilling[0].cached if prefilling else 0
        chunks = self._prefill_chunks(prefilling, self.chunk_limit(len(decoding), prefix))
        budget = self.budget
        observed = budget.observed if budget is not None else None
        started = observed.clock() if observed is not None else 0.0
        if chunks and decoding and self.packs and not any(r.params.adapter for r, _ in chunks) and not any(r.params.adapter for r in decoding):
            finished += self._run(chunks + [(r, 1) for r in decoding], packed=True)  # a mixed step: one forward
            self.stats["mixed_steps"] += 1
            if budget is not None and observed is not None:  # how the served step compares with the measurement
                predicted = budget.costs.mixed_time(sum(n for _, n in chunks), len(decoding), prefix)
                observed.observe_mixed(observed.clock() - started, predicted)
        else:
            for group, is_prefill in ((chunks, True), ([(r, 1) for r in decoding], False)):
                group = [(r, n) for r, n in group if r in self.running]
                if group and not is_prefill and self.speculative is not None:
                    finished += self.speculative.decode(self, [r for r, _ in group])
                elif group:
                    finished += self._run(group)
        self.stats["steps"] += 1
        return finished

    def _prefill_chunks(self, prefilling: list[Request], budget: int | None) -> list[tuple[Request, int]]:
        """(request, tokens to prefill this step) of the requests still prefilling, within the step's prefill chunk."""
        out = []
        for r in prefilling:
            left = len(r.tokens) - r.cached
            take = left if budget is None else min(left, budget)
            if take < 1:
                break
            out.append((r, take))
            budget = None if budget is None else budget - take
        return out

    def _drop_aborted(self) -> list[Request]:
        with self.lock:
            aborts, self.aborts = self.aborts, set()
            waiting = [r for r in self.waiting if r.id in aborts]
            for r in waiting:
                self.waiting.remove(r)
        done = waiting + [r for r in self.running if r.id in aborts]
        for r in done:
            self._finish(r, "abort")
        self.stats["aborted"] += len(done)
        return done

    def _admit(self) -> list[Request]:
        """Waiting requests that join now: continuous batching admits whenever there is room; static only into an empty batch."""
        p = self.policy
        if p.policy == "static" and self.running:
            return []
        admitted: list[Request] = []
        pending: set[bytes] = set()  # names of the blocks this step's newcomers will fill
        chunk = self.chunk_limit(sum(r.prefilled for r in self.running), 0)
        budget = p.max_prefill_tokens if chunk is None else chunk - sum(len(r.tokens) - r.cached for r in self.running if not r.prefilled)
        with self.lock:
            while self.waiting and len(self.running) < p.max_batch and (chunk is None or budget > 0):
                req = self.waiting[0]
                n = len(req.tokens)
                hit = self.prefixes.adopt(req.id, req.tokens) if self.prefixes is not None and req.offloaded is None else 0
                too_many = chunk is None and admitted and n - hit > budget
                if too_many or not self.alloc.can_grow(req.id, n) or self._shares_pending(req, hit, pending):
                    self.alloc.release(req.id)  # the cached blocks it adopted go back as they were
                    break
                self.waiting.popleft()
                self.alloc.grow(req.id, n)
                req.cached = hit if req.offloaded is None else self._restore(req)
                self.stats["prefix_hit_tokens"] += hit
                self.running.append(req)
                admitted.append(req)
                budget -= n - hit
        return admitted

    def _shares_pending(self, req: Request, hit: int, pending: set[bytes]) -> bool:
        """With prefix caching: whether a newcomer of this step will fill the block this request would prefill next; it
        then waits one step and shares that block instead of computing it twice (n choices, a burst behind one system
        prompt)."""
        if self.prefixes is None:
            return False
        keys = self.prefixes.chain(req.tokens)
        first_new = hit // self.alloc.block_size
        if first_new < len(keys) and keys[first_new] in pending:
            return True
        pending.update(keys[first_new:])
        return False

    def _make_room(self, decoding: list[Request]) -> list[Request]:
        """Give each decoding request a slot for its next token, preempting the latest-admitted ones when blocks run out."""
        ready = []
        for req in list(decoding):
            while req in self.running and not self.alloc.can_grow(req.id, req.cached + 1):
                victim = self.running[-1]
                self._preempt(victim)
            if req in self.running:
                self.alloc.grow(req.id, req.cached + 1)
                ready.append(req)
        return [r for r in ready if r in self.running]

    def _offload(self, req: Request) -> None:
        """Keep a preempted request's cached keys and values in host memory (kv_offload), to skip its recomputation; under
        tensor or pipeline parallelism every rank keeps its own heads and layers of them (runner.KVMove)."""
        if self.policy.kv_offload and req.cached > 0:
            self.runner.move_kv(KVMove("offload", req.id, self.alloc.slots(req.id, 0, req.cached)))
            req.offloaded = {"tokens": req.cached}
            self.stats["offloaded_tokens"] += req.cached

    def _restore(self, req: Request) -> int:
        """Bring an offloaded request's keys and values back into its new blocks; how many tokens they hold."""
        assert req.offloaded is not None
        count = int(req.offloaded["tokens"])
        self.runner.move_kv(KVMove("restore", req.id, self.alloc.slots(req.id, 0, count)))
        req.offloaded = None
        self.stats["restored_tokens"] += count
        return count

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._offload(req)
        self.alloc.release(req.id)
        if self.speculative is not None:
            self.speculative.release(req.id)
        req.cached, req.prefilled = 0, False
        req.epoch += 1
        with self.lock:
            self.waiting.appendleft(req)
        self.stats["preemptions"] += 1

    def _run(self, chunks: list[tuple[Request, int]], packed: bool = False) -> list[Request]:
        """One forward of `chunks` (request, its next n tokens), packed in one row or a row each; a token for each
        request whose tokens are all cached."""
        rows = [(r.id, r.tokens[r.cached : r.cached + n], r.cached) for r, n in chunks]
        if packed:
            batch = plan_packed_step(self.alloc, rows)
        else:  # each row's owner for decode lanes (decode_lanes.py): a preempted request comes back with a new epoch
            batch = plan_step(self.alloc, rows, [r.params.adapter for r, _ in chunks], [(r.id, r.epoch) for r, _ in chunks])
        logits = self.runner.forward(batch)
        for (r, _), (_, new, _) in zip(chunks, rows):
            self.stats["decode_tokens" if r.prefilled else "prefill_tokens"] += len(new)
            r.cached += len(new)
            if self.prefixes is not None:
                self.prefixes.register(r.id, r.tokens[: r.cached])
        ready = [i for i, (r, _) in enumerate(chunks) if r.cached == len(r.tokens)]
        group = [chunks[i][0] for i in ready]
        for r in group:
            r.prefilled = True
        if not group:
            return []
        logits = logits if len(ready) == len(chunks) else logits[torch.tensor(ready, device=logits.device)]
        params, generators = [r.params for r in group], [r.generator for r in group]
        choices = choose_tokens(logits, params, [r.tokens for r in group], generators, [r.output for r in group])
        finished = []
        for r, choice in zip(group, choices):
            if self._append(r, choice):
                finished.append(r)
        return finished

    def _append(self, req: Request, choice: TokenChoice) -> bool:
        """Add one token to a request and tell its sink; True if it finished."""
        req.first_token_at = req.first_token_at or time.perf_counter()
        if choice.token in req.params.stop_token_ids:
            return self._finish(req, "stop")
        req.output.append(choice.token)
        req.choices.append(choice)
        delta, stopped = req.tracker.update(req.output)
        if req.sink is not None:
            req.sink(Event(req.id, choice.token, delta, choice=choice))
        if stopped:
            return self._finish(req, "stop")
        if len(req.output) >= req.params.max_tokens or len(req.tokens) >= self.policy.context:
            return self._finish(req, "length")
        return False

    def _finish(self, req: Request, reason: str) -> bool:
        """Retire a request: its blocks go back, its sink gets the rest of its text and the reason."""
        req.finish_reason, req.finished_at = reason, time.perf_counter()
        if req.offloaded is not None:  # it ended while it waited with its cache in host memory
            self.runner.move_kv(KVMove("drop", req.id))
            req.offloaded = None
        if req in self.running:
            self.running.remove(req)
        self.alloc.release(req.id)
        if self.speculative is not None:
            self.speculative.release(req.id)
        self.stats["finished"] += 1
        rest = "" if reason == "abort" else req.tracker.update(req.output, final=True)[0]
        if req.sink is not None:
            req.sink(Event(req.id, None, rest, reason))
        return True

    def run_until_done(self) -> None:
        """Step until every submitted request has finished (offline generation)."""
        while not self.idle:
            self.step()

    def gauges(self) -> dict[str, Any]:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_blocks_used": self.alloc.used_blocks,
            "kv_blocks_total": self.alloc.num_blocks,
            "kv_blocks_cached": self.prefixes.cached_blocks if self.prefixes is not None else 0,
        }
