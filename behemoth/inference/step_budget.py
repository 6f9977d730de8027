"""Chunked prefill's per-step budget, measured on the served model (`--prefill-chunk auto`, Sarathi's token budget).

With chunked prefill a step runs one chunk of a waiting prompt and every running request's next token in one packed
forward (a mixed step). What a running stream feels is that step's time against a decode-only step's: the rule here
is that a mixed step may take at most `factor` (default 1.5) times the decode-only step of the same running batch.
Its time grows with the chunk's tokens (the products), with the prefix the chunk attends to (attention over the
prompt so far) and with the decode rows, which count against the budget because they are in the same forward.

At start `measure_step_costs` times, on the served model and its KV cache: decode-only steps of a few batch sizes,
and mixed steps of `rows` decode rows plus a chunk of c tokens (c = 4, 8, 16, ...), once at the start of a prompt and
once at the end of the context (its last quarter). `StepBudget.chunk(rows, prefix)` is then, at every step, the largest chunk whose
predicted time is within the factor: a decode step's time is interpolated between the measured batch sizes, a mixed step's time is
interpolated between the measured chunks (never extrapolated past the largest) and between the two prefixes. Each
time is the fastest of a few forwards timed in turn: on a CPU in this process's CPU time (other processes' load stays
out of it), on an accelerator in wall time up to the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from behemoth.errors import BehemothError
from behemoth.inference.kv_cache import BlockAllocator, StepBatch, plan_packed_step, plan_step

Forward = Callable[[StepBatch], torch.Tensor]
Clock = Callable[[], float]

CHUNKS = (4, 8, 16, 32, 64, 128, 256, 512)  # the chunk sizes a measurement tries, smallest first
DECODE_DEPTH = 32  # the position of the measured decodes' new tokens


@dataclass(frozen=True)
class StepCosts:
    """Measured seconds per step: decode-only by batch size; mixed (`rows` decodes + a chunk) by chunk size, the chunk
    at positions 0.. (shallow) and at positions `deep_prefix`.. (deep)."""

    rows: int
    decode: dict[int, float]
    shallow: dict[int, float]
    deep: dict[int, float]
    deep_prefix: int
    clock: Clock = field(default=time.process_time, compare=False)  # what timed them (`clock_of`)

    def __post_init__(self) -> None:
        if len(self.decode) < 2 or not self.shallow or set(self.shallow) != set(self.deep) or min(self.shallow) < 1:
            raise BehemothError(
                f"step costs of decode batches {sorted(self.decode)} and chunks {sorted(self.shallow)} / {sorted(self.deep)}",
                "measure decode steps of two batch sizes at least, and the same chunks (>= 1 token) at both prefixes",
            )

    def decode_time(self, rows: int) -> float:
        """A decode-only step of `rows` requests (`decode_line`)."""
        return decode_line(self.decode, rows)

    def mixed_time(self, chunk: float, rows: int, prefix: int) -> float:
        """A mixed step: `rows` decodes and a chunk of `chunk` tokens attending to `prefix` earlier positions."""
        near = envelope(self.shallow, chunk)
        far = envelope(self.deep, chunk)
        at = max(0.0, prefix / max(1, self.deep_prefix))  # past the deep prefix along the same line (attention is linear in it)
        return near + at * (far - near) + self.decode_time(rows) - self.decode_time(self.rows)


def decode_line(decode: dict[int, float], rows: int) -> float:
    """A decode-only step of `rows` requests: on the line through the measured batch sizes (made non-decreasing), past
    the largest along its last segment."""
    xs = sorted(decode)
    if rows <= xs[-1]:
        return envelope(decode, rows)
    top, below = envelope(decode, xs[-1]), envelope(decode, xs[-2])
    return top + (rows - xs[-1]) * (top - below) / (xs[-1] - xs[-2])


def envelope(times: dict[int, float], chunk: float) -> float:
    """Seconds at `chunk` on the piecewise-linear line through the measured points, made non-decreasing (a larger
    chunk never costs less; noise must not make one look cheaper)."""
    xs = sorted(times)
    ys = [times[xs[0]]]
    for x in xs[1:]:
        ys.append(max(ys[-1], times[x]))
    if chunk <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if chunk <= x1:
            return y0 + (y1 - y0) * (chunk - x0) / (x1 - x0)
    return ys[-1]


class Observed:
    """How the served mixed steps compare with the measurement: a running mean (exponential, weight `alpha` on the
    newest) of a mixed step's time over its prediction; its inverse scales the budget's limit (`StepBudget.chunk`). The
    measurement times the forward alone on a quiet cache, while a served step also plans, samples and hands tokens out;
    measured on this project's machine, the served mixed steps ran 1.12x their prediction, which held the streams to
    1.67x their decode step at a factor of 1.5. Decode-only steps are not used: their time depends on the streams'
    depth, which the measurement (at one depth) does not model, and a deep batch's decode steps made the correction
    grow the chunk (the mixed steps carry the same decode rows, so their ratio already includes them). The scale is
    bounded to [1/4, 4]; steps are timed by the measurement's clock."""

    def __init__(self, clock: Clock = time.process_time, alpha: float = 0.2) -> None:
        self.clock, self.alpha = clock, alpha
        self.mixed = 1.0
        self.mixed_steps = 0

    def observe_mixed(self, seconds: float, predicted: float) -> None:
        ratio = seconds / max(predicted, 1e-9)
        self.mixed = ratio if self.mixed_steps == 0 else (1 - self.alpha) * self.mixed + self.alpha * ratio
        self.mixed_steps += 1

    @property
    def scale(self) -> float:
        """The factor on the limit: the prediction over the served mixed steps' time (1 before any was seen)."""
        return 1.0 if not self.mixed_steps else min(4.0, max(0.25, 1.0 / self.mixed))


@dataclass(frozen=True)
class StepBudget:
    """The rule: a mixed step's predicted time <= `factor` x the decode-only step of the same batch, corrected by the
    served steps where `observed` is given (the scheduler's measured budget); `cap` bounds a chunk (the scheduler's
    prefill tokens per step) and is the chunk when nothing decodes (no stream to stall)."""

    costs: StepCosts
    factor: float = 1.5
    cap: int = 4096
    observed: Observed | None = field(default=None, compare=False)  # the served steps' correction (None: none)

    def __post_init__(self) -> None:
        check_factor(self.factor)

    def chunk(self, rows: int, prefix: int) -> int:
        """The largest chunk (tokens) within the factor for `rows` decoding requests and a prompt `prefix` tokens in;
        at least the smallest measured chunk (so a prompt always advances), at most the largest measured one."""
        if rows == 0:
            return self.cap
        limit = self.factor * self.costs.decode_time(rows) * (self.observed.scale if self.observed is not None else 1.0)
        lo, hi = min(self.costs.shallow), min(self.cap, max(self.costs.shallow))
        if self.costs.mixed_time(lo, rows, prefix) > limit:
            return min(lo, self.cap)
        while lo < hi:  # the predicted time is non-decreasing in the chunk: bisect for the last one within the limit
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.costs.mixed_time(mid, rows, prefix) <= limit else (lo, mid - 1)
        return lo

    def describe(self) -> str:
        """The rule and the measured numbers, for the server's start line."""
        c = self.costs
        chunks = sorted(c.shallow)
        ms = lambda t: f"{1e3 * t:.1f}"  # noqa: E731
        return (
            f"prefill chunk auto: a step of a prompt's chunk and the decodes within {self.factor:g}x of a decode-only step. "
            f"Measured: decode-only {', '.join(f'{n} rows {ms(t)} ms' for n, t in sorted(c.decode.items()))}; "
            f"{c.rows} decodes + a chunk of {'/'.join(map(str, chunks))} tokens: "
            f"{'/'.join(ms(c.shallow[k]) for k in chunks)} ms at position 0, {'/'.join(ms(c.deep[k]) for k in chunks)} ms at "
            f"position {c.deep_prefix}. Chunk for {c.rows} decodes: {self.chunk(c.rows, 0)} tokens at position 0, "
            f"{self.chunk(c.rows, c.deep_prefix)} at {c.deep_prefix}"
        )


def check_factor(factor: float) -> None:
    if not factor > 1.0:
        raise BehemothError(
            f"a prefill step factor of {factor}: a step that also prefills always takes longer than a decode-only step",
            "use a factor above 1, e.g. --prefill-step-factor 1.5",
        )


def clock_of(out: torch.Tensor | None) -> Clock:
    """On a CPU this process's CPU time (other processes' load stays out of the budget; with several intra-op threads it
    counts each one's time, which only makes the budget more cautious); on an accelerator the wall clock."""
    return time.process_time if out is None or out.device.type == "cpu" else time.perf_counter


def timed(forward: Forward, batch: StepBatch, clock: Clock) -> float:
    """Seconds of one forward up to its result (`.item()` waits for an accelerator)."""
    start = clock()
    out = forward(batch)
    if out is not None:
        out[:1, :1].sum().item()
    return clock() - start


def chunk_sizes(context: int) -> tuple[list[int], int]:
    """The chunks a measurement tries (up to a quarter of the context) and the prefix of its deep measurements (the
    rest: the deepest a chunk of each size can start; deeper prefixes extrapolate at most a third past it)."""
    sizes = [c for c in CHUNKS if c <= context // 4]
    if not sizes:
        raise BehemothError(f"--prefill-chunk auto with a context of {context} tokens", f"use a context of {4 * CHUNKS[0]} or more, or a fixed chunk")
    return sizes, context - sizes[-1]


def measure_step_costs(
    forward: Forward,
    num_blocks: int,
    block_size: int,
    *,
    context: int,
    rows: int,
    max_rows: int,
    factor: float,
    repeats: int = 7,
    time_limit_s: float = 30,
) -> StepCosts:
    """Time decode-only and mixed steps on the model behind `forward` (its KV cache's free slots take junk keys, given
    back at once). A first round finds the chunks to measure: they grow until a mixed step exceeds `factor` x the
    decode step of `max_rows`, `time_limit_s` is spent, or a quarter of the context is reached; `repeats - 1` more rounds time
    every step again in turn (a burst of other work then spoils one sample of each, not every sample of one)."""
    sizes, deep_prefix = chunk_sizes(context)
    decode_rows = sorted({1, rows, max(rows, min(max_rows, 4 * rows))})
    depth = min(DECODE_DEPTH, context // 2)  # the decodes' position: a stream some tokens in
    need = -(-context // block_size) + max(decode_rows) * -(-(depth + 1) // block_size)
    if need > num_blocks:
        raise BehemothError(
            f"--prefill-chunk auto measures a step at the end of the context ({context} tokens) beside {max(decode_rows)} decodes: "
            f"{need} KV blocks, the cache has {num_blocks}",
            "give the cache more memory (--kv-cache-mb) or use --prefill-chunk N",
        )
    alloc = BlockAllocator(num_blocks, block_size)  # its own table over the cache's slots: nothing is running yet
    for r in range(max(decode_rows)):
        alloc.grow(("decode", r), depth + 1)
    alloc.grow("prompt", context)
    decodes = [(("decode", r), [1], depth) for r in range(max(decode_rows))]
    steps = {("decode", n): plan_step(alloc, decodes[:n]) for n in decode_rows}
    clock = clock_of(forward(steps["decode", 1]))  # untimed: the first forward builds what later ones reuse
    times = {key: timed(forward, batch, clock) for key, batch in steps.items()}
    limit, started = factor * decode_line({n: times["decode", n] for n in decode_rows}, max_rows), time.perf_counter()
    for c in sizes:
        for kind, prefix in (("shallow", 0), ("deep", deep_prefix)):
            steps[kind, c] = plan_packed_step(alloc, [("prompt", [1] * c, prefix), *decodes[:rows]])
            forward(steps[kind, c])  # untimed: a new shape
            times[kind, c] = timed(forward, steps[kind, c], clock)
        if min(times["shallow", c], times["deep", c]) > limit or time.perf_counter() - started > time_limit_s:
            break
    for _ in range(repeats - 1):
        for key, batch in steps.items():
            times[key] = min(times[key], timed(forward, batch, clock))
    table = {kind: {c: t for (k, c), t in times.items() if k == kind} for kind in ("decode", "shallow", "deep")}
    return StepCosts(rows, table["decode"], table["shallow"], table["deep"], deep_prefix, clock)
