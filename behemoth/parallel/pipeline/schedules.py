"""Pipeline schedules as data: pure functions from (stages, microbatches, chunks) to per-rank action lists.

The vocabulary (`Kind`, `Action`, `Schedule`, how p2p is inserted) is in actions.py; this file builds the
one-stage-per-rank schedules, interleaving and Chimera, and holds the registry every caller goes through
(`build_schedule`); the V-shaped zero-bubble schedules are in vshape.py, Merak's shifted critical path in shifted.py.
"""

from __future__ import annotations

from collections.abc import Callable

from behemoth.parallel.pipeline.actions import (
    BACKWARDS,
    COMPUTE,
    RECVS,
    SENDS,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    compute_action,
    linear_schedule,
    with_communication,
)
from behemoth.parallel.pipeline.refusals import SCHEDULE_NAMES, V_SCHEDULES, check_request
from behemoth.parallel.pipeline.shifted import one_f_one_b_scp
from behemoth.parallel.pipeline.vshape import dualpipev, zbv

__all__ = ["BACKWARDS", "COMPUTE", "RECVS", "SENDS", "Action", "Kind", "Schedule", "ScheduleError", "check_request", "with_communication"]


# ---------------------------------------------------------------- the schedules


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward; stashes all m micro-batches."""
    p, m = stages, microbatches
    check_request("gpipe", p, m)
    place = lambda s, mb: (s, 0)  # noqa: E731
    forwards = [[compute_action(Kind.FORWARD, r, mb, place) for mb in range(m)] for r in range(p)]
    order = [forwards[r] + [compute_action(Kind.BACKWARD, r, mb, place) for mb in range(m)] for r in range(p)]
    return linear_schedule("gpipe", p, m, order, split=False)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush / DAPPLE): p-r-1 warm-up forwards, then alternate; rank r stashes min(p-r, m)."""
    p, m = stages, microbatches
    check_request("1f1b", p, m)
    place = lambda s, mb: (s, 0)  # noqa: E731
    order = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        ops = [compute_action(Kind.FORWARD, r, mb, place) for mb in range(warmup)]
        for i in range(m):
            if warmup + i < m:
                ops.append(compute_action(Kind.FORWARD, r, warmup + i, place))
            ops.append(compute_action(Kind.BACKWARD, r, i, place))
        order.append(ops)
    return linear_schedule("1f1b", p, m, order, split=False)


def zb_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023): 1F1B with backward split into input-gradient (BI) and weight-gradient (W) passes.

    A rank defers its W passes as long as it holds at most p micro-batches in flight (forward done, W
    not yet: 1F1B's peak, now on every rank), so input gradients travel back faster; in the cool-down
    each BI is followed by one W, which fills the wait for the next gradient; the rest come last.
    """
    p, m = stages, microbatches
    check_request("zb-h1", p, m)
    place = lambda s, mb: (s, 0)  # noqa: E731
    order = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        ops = [compute_action(Kind.FORWARD, r, mb, place) for mb in range(warmup)]
        fwd, wgt = warmup, 0
        for i in range(m):
            if fwd < m:
                while fwd + 1 - wgt > p:  # the next forward would exceed 1F1B's peak: retire a W first
                    ops.append(compute_action(Kind.BACKWARD_WEIGHT, r, wgt, place))
                    wgt += 1
                ops.append(compute_action(Kind.FORWARD, r, fwd, place))
                fwd += 1
            ops.append(compute_action(Kind.BACKWARD_INPUT, r, i, place))
            if fwd == m and wgt <= i:  # cool-down: each W fills the wait for the next input gradient
                ops.append(compute_action(Kind.BACKWARD_WEIGHT, r, wgt, place))
                wgt += 1
        ops += [compute_action(Kind.BACKWARD_WEIGHT, r, mb, place) for mb in range(wgt, m)]
        order.append(ops)
    return linear_schedule("zb-h1", p, m, order, split=True)


def _interleaved_pass(kind: Kind, k: int, rank: int, p: int, v: int) -> Action:
    """Rank's k-th forward or backward, as Megatron-LM orders them: each group of p micro-batches sweeps
    the chunks in turn, forwards from chunk 0 up, backwards from chunk v-1 down."""
    chunk = (k % (p * v)) // p
    chunk = chunk if kind is Kind.FORWARD else v - 1 - chunk
    return Action(kind, chunk * p + rank, (k // (p * v)) * p + k % p, chunk)


def interleaved(stages: int, microbatches: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): rank r holds stages r, r+p, ..., r+(v-1)p."""
    p, m, v = stages, microbatches, chunks
    check_request("interleaved", p, m, v)
    place = lambda s, mb: (s % p, s // p)  # noqa: E731
    total = m * v
    order = []
    for r in range(p):
        warmup = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)  # Megatron's warm-up count
        ops = [_interleaved_pass(Kind.FORWARD, k, r, p, v) for k in range(warmup)]
        for i in range(total - warmup):
            ops += [_interleaved_pass(Kind.FORWARD, warmup + i, r, p, v), _interleaved_pass(Kind.BACKWARD, i, r, p, v)]
        ops += [_interleaved_pass(Kind.BACKWARD, k, r, p, v) for k in range(total - warmup, total)]
        order.append(ops)
    per_rank = with_communication(order, place, p * v)
    for actions in per_rank:
        actions.append(Action(Kind.OPT_STEP))
    stage_ranks = tuple((s % p,) for s in range(p * v))
    chunk_stages = tuple(tuple(c * p + r for c in range(v)) for r in range(p))
    return Schedule("interleaved", p, m, v, per_rank, stage_ranks, chunk_stages, (0,) * m, False)


def _chimera_pick(rank: int, slot: int, d: int, half: int, counts: dict, done: dict) -> Action | None:
    """The pass `rank` starts at `slot`: a ready backward, else a ready forward under its stage's cap; deeper first."""
    candidates = []
    for chunk, stage in enumerate((rank, d - 1 - rank)):
        first = 0 if chunk == 0 else half  # micro-batches 0..N/2-1 go down, N/2..N-1 go up
        f, b = counts[(rank, chunk, Kind.FORWARD)], counts[(rank, chunk, Kind.BACKWARD)]
        if b < f and (stage == d - 1 or done.get((Kind.BACKWARD, stage + 1, first + b), slot + 1) <= slot):
            candidates.append((0, -stage, chunk, Action(Kind.BACKWARD, stage, first + b, chunk)))
        if f < half and f - b < min(d // 2, d - stage) and (stage == 0 or done.get((Kind.FORWARD, stage - 1, first + f), slot + 1) <= slot):
            candidates.append((1, -stage, chunk, Action(Kind.FORWARD, stage, first + f, chunk)))
    return min(candidates)[-1] if candidates else None


def _chimera_order(d: int, n: int) -> list[list[Action]]:
    """Each rank's compute order, from list scheduling in unit slots (F and B one slot each, as the paper draws)."""
    half = n // 2
    counts = {(r, c, k): 0 for r in range(d) for c in (0, 1) for k in (Kind.FORWARD, Kind.BACKWARD)}
    done: dict[tuple[Kind, int, int], int] = {}  # (kind, stage, microbatch) -> slot by whose start it is done
    order: list[list[Action]] = [[] for _ in range(d)]
    slot, left = 0, 2 * n * d
    while left:
        picks = [(r, a) for r in range(d) if (a := _chimera_pick(r, slot, d, half, counts, done)) is not None]
        if not picks:
            raise AssertionError(f"chimera({d}, {n}): no pass can start at slot {slot}")
        for r, a in picks:
            done[(a.kind, a.stage, a.microbatch)] = slot + 1
            counts[(r, a.chunk, a.kind)] += 1
            order[r].append(a)
        slot, left = slot + 1, left - len(picks)
    return order


def chimera(stages: int, microbatches: int) -> Schedule:
    """Chimera (Li & Hoefler 2021) with two pipelines: rank i holds stage i of the down pipeline (chunk 0)
    and stage D-1-i of the up pipeline (chunk 1); micro-batches 0..N/2-1 run down, N/2..N-1 run up.

    N is `microbatches`, the micro-batches of one optimizer step, a multiple of D: each rank runs
    every one of them once, N/2 through each of its two stages. The order comes from list scheduling in unit slots
    (F and B one slot each): each slot, a rank starts a ready backward, else a ready forward, the
    deeper stage first, with at most min(D/2, D-s) micro-batches in flight on a pipeline's stage s,
    the memory of the paper's basic unit of D micro-batches. For N = D this is the paper's basic unit;
    for N = kD it concatenates k units with the next unit's forwards filling the previous one's tail,
    and the bubble is the paper's (D-2)/(2N+D-2) when F and B take equal time (see `simulate`).
    Both replicas of a stage all-reduce their gradients (GRAD_SYNC) before the optimizer step.
    """
    d, n = stages, microbatches
    check_request("chimera", d, n)
    half = n // 2
    place = lambda s, mb: (s, 0) if mb < half else (d - 1 - s, 1)  # noqa: E731
    per_rank = with_communication(_chimera_order(d, n), place, d)
    for rank, actions in enumerate(per_rank):
        for chunk, stage in sorted(enumerate((rank, d - 1 - rank)), key=lambda cs: cs[1]):
            actions.append(Action(Kind.GRAD_SYNC, stage, -1, chunk, peer=d - 1 - rank))
        actions.append(Action(Kind.OPT_STEP))
    return Schedule(
        "chimera",
        d,
        n,
        2,
        per_rank,
        tuple((s, d - 1 - s) for s in range(d)),
        tuple((r, d - 1 - r) for r in range(d)),
        tuple(0 if mb < half else 1 for mb in range(n)),
        False,
    )


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
    "chimera": chimera,
    "zbv": zbv,
    "dualpipev": dualpipev,
    "1f1b-scp": one_f_one_b_scp,
}
assert tuple(SCHEDULES) == SCHEDULE_NAMES, "every schedule is named in refusals.py, in the same order"


def build_schedule(name: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The named schedule for `stages` pipeline ranks and `microbatches` per step; refuses impossible requests."""
    check_request(name, stages, microbatches, chunks)
    if name == "interleaved":
        return interleaved(stages, microbatches, chunks)
    return SCHEDULES[name](stages, microbatches)


def schedule_chunks(name: str, chunks: int) -> int:
    """Model chunks per rank that schedule `name` holds, given the configured `chunks` (used by interleaving only)."""
    return chunks if name == "interleaved" else 2 if name in V_SCHEDULES else 1
