"""Pipeline schedules as data: pure functions from (stages, microbatches, chunks) to per-rank action lists.

A schedule says, for every pipeline rank, the exact order of its compute passes (forward, backward,
or zero-bubble's split input-gradient and weight-gradient passes), its point-to-point transfers,
Chimera's gradient sync between the two replicas of a stage, and the optimizer step. Nothing here
touches a device: `validate.py` proves a schedule complete and deadlock-free, `simulate.py` times it,
and the executor runs the same `Action`s with real tensors.

Conventions an executor can rely on:
- `stage` is the model stage (0 .. num_stages-1; with interleaving num_stages = p*v); `chunk` is the
  index of the local model chunk on the rank that runs the action (`Schedule.chunk_stages[rank][chunk]`).
- A transfer is named by the tensor it carries: SEND_ACT/RECV_ACT with `stage=s` carry the output of
  stage s's forward (the input of stage s+1); SEND_GRAD/RECV_GRAD with `stage=s` carry the gradient
  produced by stage s's backward (w.r.t. its input, consumed by stage s-1). A send and its receive
  therefore have the same (payload, stage, microbatch), with `peer` naming the other rank.
- Sends are non-blocking; a RECV is placed right before the first action that needs the tensor, so
  it marks the latest point by which the message must have arrived (an executor may post it earlier).
- Consecutive stages on the same rank (interleaving with p=1) hand tensors over locally, with no p2p.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from behemoth.errors import BehemothError


class ScheduleError(BehemothError):
    """A schedule that is impossible to build, incomplete, inconsistent, or would deadlock."""


class Kind(enum.Enum):
    """What an action does; the value is the short label used in grids and charts."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input gradient and weight gradient together
    BACKWARD_INPUT = "BI"  # zero-bubble's "B": gradient w.r.t. the stage input only
    BACKWARD_WEIGHT = "W"  # zero-bubble's "W": gradient w.r.t. the stage weights
    FORWARD_BACKWARD = "FB"  # the last stage's forward, loss and backward at once (a streamed step's head)
    EVALUATE = "E"  # the last stage's forward and loss only (a streamed evaluation's head)
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    GRAD_SYNC = "GRAD_SYNC"  # all-reduce of one stage's gradients between its two Chimera replicas
    OPT_STEP = "OPT_STEP"


COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT})
BACKWARDS = frozenset({Kind.BACKWARD, Kind.BACKWARD_INPUT})  # passes that produce the input gradient
SENDS = {Kind.SEND_ACT: Kind.RECV_ACT, Kind.SEND_GRAD: Kind.RECV_GRAD}
RECVS = {recv: send for send, recv in SENDS.items()}


@dataclass(frozen=True)
class Action:
    """One instruction for one rank: a compute pass, a transfer, a gradient sync or the optimizer step. A streamed
    (offloaded) step's order is a list of these too, one rank's compute passes with `stage` the unit it computes."""

    kind: Kind
    stage: int = -1
    microbatch: int = -1
    chunk: int = 0
    peer: int | None = None

    @property
    def label(self) -> str:
        """Short grid label such as `F3`, `B3`, `W3` (the input-gradient pass also shows as `B`)."""
        kind = "B" if self.kind is Kind.BACKWARD_INPUT else self.kind.value
        return f"{kind}{self.microbatch}" if self.kind in COMPUTE else self.kind.value

    def __str__(self) -> str:
        if self.kind is Kind.OPT_STEP:
            return "OPT_STEP"
        where = f"stage={self.stage}" + (f", mb={self.microbatch}" if self.microbatch >= 0 else "")
        if self.peer is None:
            return f"{self.kind.value}({where})"
        arrow = "to" if self.kind in SENDS else "from" if self.kind in RECVS else "with"
        return f"{self.kind.value}({where}, {arrow} rank {self.peer})"


@dataclass(frozen=True)
class Schedule:
    """Per-rank action lists plus the placement an executor and the validator need."""

    name: str
    ranks: int  # p: pipeline ranks (D for Chimera)
    microbatches: int  # m: micro-batches per optimizer step, over all pipelines
    chunks: int  # v: model chunks per rank (2 for Chimera: its down stage and its up stage)
    per_rank: list[list[Action]]
    stage_ranks: tuple[tuple[int, ...], ...]  # stage -> rank of each replica (two for Chimera)
    chunk_stages: tuple[tuple[int, ...], ...]  # rank -> chunk -> stage
    replica_of_microbatch: tuple[int, ...]  # microbatch -> which replica of every stage runs it
    split_backward: bool  # True: BI + W passes; False: one B pass

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    def rank_of(self, stage: int, microbatch: int) -> int:
        """The rank that runs `stage` for `microbatch`."""
        return self.stage_ranks[stage][self.replica_of_microbatch[microbatch]]


# ---------------------------------------------------------------- assembling actions


def _compute(kind: Kind, stage: int, mb: int, placement: Callable[[int, int], tuple[int, int]]) -> Action:
    return Action(kind, stage, mb, chunk=placement(stage, mb)[1])


def with_communication(order: list[list[Action]], placement: Callable[[int, int], tuple[int, int]], num_stages: int) -> list[list[Action]]:
    """Insert p2p around each rank's compute order: RECV right before the consumer, SEND right after the producer."""
    per_rank: list[list[Action]] = []
    for rank, compute in enumerate(order):
        actions: list[Action] = []
        for a in compute:
            s, mb = a.stage, a.microbatch
            if a.kind is Kind.FORWARD and s > 0 and (src := placement(s - 1, mb)[0]) != rank:
                actions.append(Action(Kind.RECV_ACT, s - 1, mb, a.chunk, src))
            if a.kind in BACKWARDS and s < num_stages - 1 and (src := placement(s + 1, mb)[0]) != rank:
                actions.append(Action(Kind.RECV_GRAD, s + 1, mb, a.chunk, src))
            actions.append(a)
            if a.kind is Kind.FORWARD and s < num_stages - 1 and (dst := placement(s + 1, mb)[0]) != rank:
                actions.append(Action(Kind.SEND_ACT, s, mb, a.chunk, dst))
            if a.kind in BACKWARDS and s > 0 and (dst := placement(s - 1, mb)[0]) != rank:
                actions.append(Action(Kind.SEND_GRAD, s, mb, a.chunk, dst))
        per_rank.append(actions)
    return per_rank


def _linear_schedule(name: str, p: int, m: int, order: list[list[Action]], split: bool) -> Schedule:
    """A schedule where stage s lives on rank s: add p2p and the optimizer step."""
    placement = lambda stage, mb: (stage, 0)  # noqa: E731
    per_rank = with_communication(order, placement, p)
    for actions in per_rank:
        actions.append(Action(Kind.OPT_STEP))
    return Schedule(name, p, m, 1, per_rank, tuple((s,) for s in range(p)), tuple((r,) for r in range(p)), (0,) * m, split)


# ---------------------------------------------------------------- the schedules


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe (Huang et al. 2019): every forward, then every backward; stashes all m micro-batches."""
    p, m = stages, microbatches
    check_request("gpipe", p, m)
    place = lambda s, mb: (s, 0)  # noqa: E731
    order = [[_compute(Kind.FORWARD, r, mb, place) for mb in range(m)] + [_compute(Kind.BACKWARD, r, mb, place) for mb in range(m)] for r in range(p)]
    return _linear_schedule("gpipe", p, m, order, split=False)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush / DAPPLE): p-r-1 warm-up forwards, then alternate; rank r stashes min(p-r, m)."""
    p, m = stages, microbatches
    check_request("1f1b", p, m)
    place = lambda s, mb: (s, 0)  # noqa: E731
    order = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        ops = [_compute(Kind.FORWARD, r, mb, place) for mb in range(warmup)]
        for i in range(m):
            if warmup + i < m:
                ops.append(_compute(Kind.FORWARD, r, warmup + i, place))
            ops.append(_compute(Kind.BACKWARD, r, i, place))
        order.append(ops)
    return _linear_schedule("1f1b", p, m, order, split=False)


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
        ops = [_compute(Kind.FORWARD, r, mb, place) for mb in range(warmup)]
        fwd, wgt = warmup, 0
        for i in range(m):
            if fwd < m:
                while fwd + 1 - wgt > p:  # the next forward would exceed 1F1B's peak: retire a W first
                    ops.append(_compute(Kind.BACKWARD_WEIGHT, r, wgt, place))
                    wgt += 1
                ops.append(_compute(Kind.FORWARD, r, fwd, place))
                fwd += 1
            ops.append(_compute(Kind.BACKWARD_INPUT, r, i, place))
            if fwd == m and wgt <= i:  # cool-down: each W fills the wait for the next input gradient
                ops.append(_compute(Kind.BACKWARD_WEIGHT, r, wgt, place))
                wgt += 1
        ops += [_compute(Kind.BACKWARD_WEIGHT, r, mb, place) for mb in range(wgt, m)]
        order.append(ops)
    return _linear_schedule("zb-h1", p, m, order, split=True)


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
}


def _refuse(name: str, p: int, m: int, v: int) -> tuple[str, str] | None:
    """(problem, fix) for a request the schedule cannot run, or None."""
    if name not in SCHEDULES:
        return f"schedule={name!r} is not one of {', '.join(SCHEDULES)}", "pick one of those"
    if p < 1:
        return f"stages={p}: a pipeline needs at least one stage", "use --stages 1 or more"
    if m < 1:
        return f"microbatches={m}: a step needs at least one micro-batch", f"use --microbatches {p} or more to fill the pipeline"
    if name != "interleaved" and v != 1:
        return f"chunks={v}: only the interleaved schedule holds several model chunks per rank", "drop --chunks or use interleaved"
    if name == "interleaved" and v < 2:
        return f"chunks={v}: interleaved 1F1B needs at least 2 model chunks per rank", "use --chunks 2 or more, or the 1f1b schedule"
    if name == "interleaved" and m % p:
        return (
            f"microbatches={m}: interleaved 1F1B needs micro-batches divisible by stages={p} (as Megatron-LM)",
            f"use --microbatches {m + p - m % p}",
        )
    if name == "chimera" and p % 2:
        return (
            f"stages={p}: Chimera needs an even number of stages (rank i holds stages i and D-1-i)",
            f"use --stages {p + 1}" + (f" or {p - 1}" if p > 1 else ""),
        )
    if name == "chimera" and m % p:
        lower = f"{m - m % p} or " if m > p else ""
        return (
            f"microbatches={m}: Chimera runs whole basic units of D={p} micro-batches (D/2 down, D/2 up)",
            f"use --microbatches {lower}{m + p - m % p}",
        )
    return None


def check_request(name: str, p: int, m: int, v: int = 1) -> None:
    """Raise ScheduleError (value, constraint, fix) unless schedule `name` can run p ranks, m micro-batches, v chunks."""
    refusal = _refuse(name, p, m, v)
    if refusal is not None:
        raise ScheduleError(*refusal)


def build_schedule(name: str, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The named schedule for `stages` pipeline ranks and `microbatches` per step; refuses impossible requests."""
    check_request(name, stages, microbatches, chunks)
    if name == "interleaved":
        return interleaved(stages, microbatches, chunks)
    return SCHEDULES[name](stages, microbatches)
