"""Speculative decoding: a small draft model proposes K tokens per decoding request, the target checks them in one forward.

Each step, for every decoding request, the draft (its own paged KV cache, keyed by the same request ids) runs K
cheap forwards and proposes d1..dK; the target runs one forward of [last token, d1..dK] and so has the
logits after each. Greedy rows keep the drafts while each equals the target's own choice (argmax of its
processed logits at that position) and then take the target's choice: the tokens are exactly those of the
target alone. Sampled rows use the rejection rule of Leviathan et al. / Chen et al. (2023): keep d_i with
probability min(1, p(d_i) / q(d_i)), p and q the target's and draft's processed distributions; at the first
refusal draw from normalize(max(0, p - q)); when all K are kept draw one more from p. Every token is then
distributed as the target's own sampling would draw it (the draws themselves differ from the non-speculative
run with the same seed). A request gets up to K + 1 tokens per step; rejected positions' keys and values
stay in the cache past its length and are overwritten before anything attends to them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, cast

import torch

from behemoth.errors import BehemothError
from behemoth.inference.kv_cache import BlockAllocator, plan_step
from behemoth.inference.runner import ModelRunner, Runner
from behemoth.inference.sampling import SamplingParams, TokenChoice, processed_logits, sampling_probs, token_choices

if TYPE_CHECKING:
    from behemoth.inference.scheduler import Request, Scheduler


def speculative_sample(p: torch.Tensor, q: torch.Tensor, drafts: list[int], generator: torch.Generator | None) -> list[int]:
    """The tokens a sampled row keeps: drafts accepted by the rejection rule, then one drawn from the residual (at a
    refusal) or from p's last row (all kept). p: [k + 1, V] target, q: [k, V] draft distributions."""
    for i, d in enumerate(drafts):
        u = float(torch.rand((), generator=generator))
        if u < float(p[i, d]) / float(q[i, d]):
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        residual = residual if float(residual.sum()) > 0 else p[i]
        return drafts[:i] + [int(torch.multinomial(residual / residual.sum(), 1, generator=generator))]
    return drafts + [int(torch.multinomial(p[len(drafts)], 1, generator=generator))]


def greedy_accept(logits: torch.Tensor, drafts: list[int]) -> list[int]:
    """The tokens a greedy row keeps: drafts while each equals the target's argmax there, then the target's own choice."""
    choice = logits.argmax(dim=-1).tolist()
    kept = 0
    while kept < len(drafts) and drafts[kept] == choice[kept]:
        kept += 1
    return drafts[:kept] + [choice[kept]]


def point_masses(drafts: list[int], vocab_size: int) -> torch.Tensor:
    """[k, V]: the distributions of deterministic proposals (n-gram lookup): all mass on each proposed token."""
    return torch.nn.functional.one_hot(torch.tensor(drafts, dtype=torch.long), vocab_size).float()


def positions_of(req: Request, drafts: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """(tokens seen, tokens generated) before each of the k + 1 checked positions: the penalties' histories."""
    return [req.tokens + drafts[:i] for i in range(len(drafts) + 1)], [req.output + drafts[:i] for i in range(len(drafts) + 1)]


class Proposer(Protocol):
    """Where a step's proposals come from: a draft model (DraftProposer) or the request's own tokens (ngram.py)."""

    def reserve(self, req: Request, k: int) -> bool: ...

    def propose(self, rows: list[Request], ks: list[int]) -> tuple[list[list[int]], list[list[torch.Tensor]]]: ...

    def kept(self, req: Request, kept: int) -> None: ...

    def release(self, request_id: int) -> None: ...


class DraftProposer:
    """A draft model's runner and block table: K cheap forwards propose K tokens per decoding row."""

    def __init__(self, draft: Runner, alloc: BlockAllocator) -> None:
        self.draft, self.alloc = draft, alloc
        self.cached: dict[int, int] = {}  # request id -> its tokens in the draft's cache

    def reserve(self, req: Request, k: int) -> bool:
        """Room in the draft's cache for `req`'s k proposals (taken now), or False."""
        if not self.alloc.can_grow(req.id, len(req.tokens) + k - 1):
            return False
        self.alloc.grow(req.id, max(self.alloc.lengths.get(req.id, 0), len(req.tokens) + k - 1))
        return True

    def kept(self, req: Request, kept: int) -> None:
        """`req` kept `kept` tokens (its drafts and the target's own): the draft's cache is valid up to them."""
        self.cached[req.id] = min(self.cached.get(req.id, 0), len(req.tokens) + kept - 1)

    def release(self, request_id: int) -> None:
        self.alloc.release(request_id)
        self.cached.pop(request_id, None)

    def propose(self, rows: list[Request], ks: list[int]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """Each row's draft tokens (k of them) and, for sampled rows, the draft distribution each was drawn from."""
        drafts: list[list[int]] = [[] for _ in rows]
        dists: list[list[torch.Tensor]] = [[] for _ in rows]
        for j in range(max(ks, default=0)):
            live = [b for b, k in enumerate(ks) if k > j]
            batch = []
            for b in live:
                r = rows[b]
                start = self.cached.get(r.id, 0) if j == 0 else len(r.tokens) + j - 1
                new = r.tokens[start:] if j == 0 else [drafts[b][-1]]
                batch.append((r.id, new, start))
                self.cached[r.id] = start + len(new)
            logits = self.draft.forward(plan_step(self.alloc, batch))
            self._choose(logits, [rows[b] for b in live], [drafts[b] for b in live], [dists[b] for b in live])
        return drafts, dists

    def _choose(self, logits: torch.Tensor, rows: list[Request], drafts: list[list[int]], dists: list[list[torch.Tensor]]) -> None:
        """Append the draft's next token to each row's proposals (argmax, or a draw kept with its distribution)."""
        params = [r.params for r in rows]
        proc = processed_logits(logits, params, [r.tokens + d for r, d in zip(rows, drafts)], [r.output + d for r, d in zip(rows, drafts)])
        for b, (r, d) in enumerate(zip(rows, drafts)):
            if r.params.greedy:
                d.append(int(proc[b].argmax()))
                continue
            q = sampling_probs(proc[b : b + 1], [r.params])[0]
            dists[b].append(q)
            d.append(int(torch.multinomial(q, 1, generator=r.generator)))


def take_blocks(alloc: BlockAllocator, req: Request, drafts: list[int]) -> None:
    """The target's blocks for `req`'s checked positions. Each row's budget saw the free blocks alone, so the rows before
    it may have taken them: the proposals that no longer fit are dropped (fewer checked; every kept token the same)."""
    while drafts and not alloc.can_grow(req.id, req.cached + 1 + len(drafts)):
        drafts.pop()
    if drafts:
        alloc.grow(req.id, max(alloc.lengths.get(req.id, 0), req.cached + 1 + len(drafts)))


class SpeculativeDecoder:
    """A proposer (draft model or n-gram lookup) and the verification of one decode step in one target forward."""

    def __init__(self, proposer: Proposer | Runner, alloc: BlockAllocator | None = None, k: int = 4) -> None:
        self.check_tokens(k)
        self.proposer: Proposer = DraftProposer(cast(Runner, proposer), alloc) if alloc is not None else cast(Proposer, proposer)
        self.k = k

    @staticmethod
    def check_tokens(k: int) -> None:
        if k < 1:
            raise BehemothError(f"--draft-tokens {k}: a draft proposes at least one token per step", "use --draft-tokens 1 or more (e.g. 4)")

    def release(self, request_id: int) -> None:
        """A request finished, was aborted or preempted: what the proposer holds for it goes back."""
        self.proposer.release(request_id)

    def budget(self, sched: Scheduler, req: Request) -> int:
        """Tokens `req` may be proposed: K, fewer near its max_tokens, 0 when the target's cache or the proposer's cannot
        hold them now (the target's blocks are taken once the proposals are known)."""
        k = min(self.k, req.params.max_tokens - len(req.output) - 1)
        if k < 1 or not sched.alloc.can_grow(req.id, req.cached + 1 + k) or not self.proposer.reserve(req, k):
            return 0
        return k

    def decode(self, sched: Scheduler, rows: list[Request]) -> list[Request]:
        """One speculative decode step of `rows` (each holds a slot for its next token): propose, verify, keep, retire."""
        ks = [self.budget(sched, r) for r in rows]
        drafts, dists = self.proposer.propose(rows, ks)
        for r, d in zip(rows, drafts):
            take_blocks(sched.alloc, r, d)
        batch = [(r.id, [r.tokens[r.cached]] + d, r.cached) for r, d in zip(rows, drafts)]
        logits = cast(ModelRunner, sched.runner).verify(plan_step(sched.alloc, batch, [r.params.adapter for r in rows]))
        sched.stats["decode_tokens"] += sum(len(new) for _, new, _ in batch)
        sched.stats["draft_tokens"] += sum(len(d) for d in drafts)
        finished = []
        for b, (r, d) in enumerate(zip(rows, drafts)):
            kept, choices = self.keep(r, d, dists[b], logits[b, : len(d) + 1])
            sched.stats["accepted_tokens"] += len(kept) - 1
            r.cached += len(kept)  # the checked tokens up to the last kept one; the new last token is not cached yet
            self.proposer.kept(r, len(kept))
            if sched.prefixes is not None:
                sched.prefixes.register(r.id, (r.tokens + kept)[: r.cached])
            if any(sched._append(r, c) for c in choices):
                finished.append(r)
        return finished

    def keep(self, req: Request, drafts: list[int], dists: list[torch.Tensor], logits: torch.Tensor) -> tuple[list[int], list[TokenChoice]]:
        """The tokens `req` keeps this step and their choices (log-probabilities under the target's raw distribution)."""
        seen, generated = positions_of(req, drafts)
        params: list[SamplingParams] = [req.params] * len(seen)
        proc = processed_logits(logits, params, seen, generated)
        if req.params.greedy:
            kept = greedy_accept(proc, drafts)
        else:
            q = torch.stack(dists) if dists else point_masses(drafts, proc.shape[-1])
            kept = speculative_sample(sampling_probs(proc, params), q, drafts, req.generator)
        return kept, token_choices(logits[: len(kept)], params[: len(kept)], kept)
