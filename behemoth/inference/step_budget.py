"""Chunked prefill's per-step budget, measured on the served model (`--prefill-chunk auto`, Sarathi's token budget).

With chunked prefill a step runs one chunk of a waiting prompt and every running request's next token in one packed
forward (a mixed step). What a running stream feels is that step's time against a decode-only step's: the rule here
is that a mixed step may take at most `factor` (default 1.5) times the decode-only step of the same running batch.
Its time grows with the chunk's tokens (the products), with the prefix the chunk attends to (attention over the
prompt so far) and with the decode rows, which count against the budget because they are in the same forward.

At start `measure_step_costs` times, on the served model and its KV cache: decode-only steps of a few batch sizes,
and mixed steps of `rows` decode rows plus a chunk of c tokens (c = 4, 8, 16, ...), once at the start of a prompt and
once at the end of the context. `StepBudget.chunk(rows, prefix)` is then, at every step, the largest chunk whose
predicted time is within the factor: a decode step's time is a line in the batch size, a mixed step's time is
interpolated between the measured chunks (never extrapolated past the largest) and between the two prefixes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from behemoth.errors import BehemothError
from behemoth.inference.kv_cache import BlockAllocator, StepBatch, plan_packed_step, plan_step

CHUNKS = (4, 8, 16, 32, 64, 128, 256, 512)  # the chunk sizes a measurement tries, smallest first


@dataclass(frozen=True)
class StepCosts:
    """Measured seconds per step: decode-only by batch size; mixed (`rows` decodes + a chunk) by chunk size, the chunk
    at positions 0.. (shallow) and at positions `deep_prefix`.. (deep)."""

    rows: int
    decode: dict[int, float]
    shallow: dict[int, float]
    deep: dict[int, float]
    deep_prefix: int

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
        at = min(1.0, max(0.0, prefix / max(1, self.deep_prefix)))
        return near + at * (far - near) + self.decode_time(rows) - self.decode_time(self.rows)


def decode_line(decode: dict[int, float], rows: int) -> float:
    """A decode-only step of `rows` requests: the least-squares line through the measured batch sizes (never falling)."""
    xs, ys = list(decode), list(decode.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-12, sum((x - mx) ** 2 for x in xs))
    return my + max(0.0, slope) * (rows - mx)


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


@dataclass(frozen=True)
class StepBudget:
    """The rule: a mixed step's predicted time <= `factor` x the decode-only step of the same batch; `cap` bounds a
    chunk (the scheduler's prefill tokens per step) and is the chunk when nothing decodes (no stream to stall)."""

    costs: StepCosts
    factor: float = 1.5
    cap: int = 4096

    def __post_init__(self) -> None:
        check_factor(self.factor)

    def chunk(self, rows: int, prefix: int) -> int:
        """The largest chunk (tokens) within the factor for `rows` decoding requests and a prompt `prefix` tokens in;
        at least the smallest measured chunk (so a prompt always advances), at most the largest measured one."""
        if rows == 0:
            return self.cap
        limit = self.factor * self.costs.decode_time(rows)
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


Forward = Callable[[StepBatch], torch.Tensor]


def timed(forward: Forward, batch: StepBatch, repeats: int) -> float:
    """The fastest of `repeats` forwards, in seconds (the least disturbed by other work; `.item()` waits for a GPU)."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = forward(batch)
        if out is not None:
            out[:1, :1].sum().item()
        best = min(best, time.perf_counter() - start)
    return best


def chunk_sizes(context: int) -> tuple[list[int], int]:
    """The chunks a measurement tries (up to half the context) and the prefix of its deep measurements (the rest)."""
    sizes = [c for c in CHUNKS if c <= context // 2]
    if not sizes:
        raise BehemothError(f"--prefill-chunk auto with a context of {context} tokens", f"use a context of {2 * CHUNKS[0]} or more, or a fixed chunk")
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
    repeats: int = 3,
    time_limit_s: float = 30,
) -> StepCosts:
    """Time decode-only and mixed steps on the model behind `forward` (its KV cache's free slots take junk keys, given
    back at once). Chunks grow until a mixed step exceeds `factor` x the decode step of `max_rows`, `time_limit_s` is
    spent, or half the context is reached."""
    sizes, deep_prefix = chunk_sizes(context)
    decode_rows = sorted({1, rows, max(rows, min(max_rows, 4 * rows))})
    need = -(-context // block_size) + max(decode_rows) * -(-2 // block_size)
    if need > num_blocks:
        raise BehemothError(
            f"--prefill-chunk auto measures a step at the end of the context ({context} tokens) beside {max(decode_rows)} decodes: "
            f"{need} KV blocks, the cache has {num_blocks}",
            "give the cache more memory (--kv-cache-mb) or use --prefill-chunk N",
        )
    alloc = BlockAllocator(num_blocks, block_size)  # its own table over the cache's slots: nothing is running yet
    for r in range(max(decode_rows)):
        alloc.grow(("decode", r), 2)
    alloc.grow("prompt", context)
    decodes = [(("decode", r), [1], 1) for r in range(max(decode_rows))]
    decode = {n: timed(forward, plan_step(alloc, decodes[:n]), repeats) for n in decode_rows}
    limit, started = factor * decode_line(decode, max_rows), time.perf_counter()
    shallow: dict[int, float] = {}
    deep: dict[int, float] = {}
    for c in sizes:
        shallow[c] = timed(forward, plan_packed_step(alloc, [("prompt", [1] * c, 0), *decodes[:rows]]), repeats)
        deep[c] = timed(forward, plan_packed_step(alloc, [("prompt", [1] * c, deep_prefix), *decodes[:rows]]), repeats)
        if min(shallow[c], deep[c]) > limit or time.perf_counter() - started > time_limit_s:
            break
    return StepCosts(rows, decode, shallow, deep, deep_prefix)
