"""V-shaped zero-bubble schedules as data: ZBV (Qi et al. 2023, section 6) and DualPipeV (DeepSeek-V3's DualPipe, folded).

Both cut the model into 2p stages and place them in a V: rank r holds chunk 0 = stage r (on the way down) and
chunk 1 = stage 2p-1-r (on the way back up), so rank 0 holds the first and the last stage, and rank p-1 holds the
two middle stages p-1 and p, which hand the activation over locally. The backward is split into the input-gradient
pass (BI, on the critical path) and the weight-gradient pass (W, which fills the bubbles). The orders follow
torch.distributed.pipelining's `ScheduleZBVZeroBubble` and `ScheduleDualPipeV` step for step, so the two systems
run the same schedule; DualPipeV's overlapped "F and B" pair of two chunks is a forward followed by a full backward
(B) here: the executor runs them one after the other (the overlap it buys is compute with an MoE all-to-all, which a
dense pipeline does not have).
"""

from __future__ import annotations

from collections.abc import Callable

from behemoth.parallel.pipeline.actions import Action, Kind, Schedule, with_communication
from behemoth.parallel.pipeline.refusals import check_request

Placement = Callable[[int, int], tuple[int, int]]


def v_placement(p: int) -> Placement:
    """(stage, micro-batch) -> (rank, chunk) in the V: stage s < p on rank s (chunk 0), s >= p on rank 2p-1-s (chunk 1)."""
    return lambda s, mb: (s, 0) if s < p else (2 * p - 1 - s, 1)


def v_schedule(name: str, p: int, m: int, order: list[list[Action]]) -> Schedule:
    """A V-placed split-backward schedule from each rank's compute order: add p2p and the optimizer step."""
    per_rank = with_communication(order, v_placement(p), 2 * p)
    for actions in per_rank:
        actions.append(Action(Kind.OPT_STEP))
    stage_ranks = tuple((s if s < p else 2 * p - 1 - s,) for s in range(2 * p))
    chunk_stages = tuple((r, 2 * p - 1 - r) for r in range(p))
    return Schedule(name, p, m, 2, per_rank, stage_ranks, chunk_stages, (0,) * m, True)


class _Order:
    """One rank's compute order under construction: per (chunk, kind) counters of the next micro-batch."""

    def __init__(self, rank: int, p: int) -> None:
        self.stages = (rank, 2 * p - 1 - rank)
        self.next: dict[tuple[int, Kind], int] = {}
        self.ops: list[Action] = []
        self.weights: list[tuple[int, int]] = []  # (chunk, micro-batch) of input passes whose W is still to come

    def add(self, chunk: int, kind: Kind) -> None:
        """Append chunk's next pass of `kind`; a full backward B counts as both the BI and the W of its micro-batch."""
        counter = Kind.BACKWARD_INPUT if kind is Kind.BACKWARD else kind
        mb = self.next.get((chunk, counter), 0)
        self.ops.append(Action(kind, self.stages[chunk], mb, chunk))
        self.next[(chunk, counter)] = mb + 1
        if kind is Kind.BACKWARD_INPUT:
            self.weights.append((chunk, mb))

    def add_weight(self, chunk: int | None = None) -> None:
        """Append the oldest deferred W (of `chunk`, or of either chunk); nothing if none is pending."""
        pending = [i for i, (c, _) in enumerate(self.weights) if chunk in (None, c)]
        if pending:
            c, mb = self.weights.pop(pending[0])
            self.ops.append(Action(Kind.BACKWARD_WEIGHT, self.stages[c], mb, c))


def _zbv_order(rank: int, p: int, m: int) -> list[Action]:
    """ZBV's compute order on `rank`, built for max(m, 2p-1) micro-batches and trimmed to m (as PyTorch does)."""
    n = max(2 * p - 1, m)
    o = _Order(rank, p)
    for _ in range(2 * (p - rank) - 1):  # warm-up: chunk 0 forwards
        o.add(0, Kind.FORWARD)
    for _ in range(rank):
        o.add(1, Kind.FORWARD)
        o.add(0, Kind.FORWARD)
    for _ in range(p - rank):  # chunk 1 starts its backward at once
        o.add(1, Kind.FORWARD)
        o.add(1, Kind.BACKWARD_INPUT)
        o.add_weight(1)
    count = lambda chunk, kind: o.next.get((chunk, kind), 0)  # noqa: E731
    while count(1, Kind.FORWARD) < count(0, Kind.FORWARD) or count(0, Kind.FORWARD) < n:  # steady: F B W on each chunk
        if count(0, Kind.FORWARD) < n:
            o.add(0, Kind.FORWARD)
        o.add(0, Kind.BACKWARD_INPUT)
        o.add_weight(0)
        o.add(1, Kind.FORWARD)
        o.add(1, Kind.BACKWARD_INPUT)
        o.add_weight(1)
    for _ in range(rank):  # cool-down: input passes first, weight passes fill the tail
        o.add(0, Kind.BACKWARD_INPUT)
        o.add(1, Kind.BACKWARD_INPUT)
    for _ in range(p - rank):
        o.add(0, Kind.BACKWARD_INPUT)
        o.add_weight(0)
    while any(c == 1 for c, _ in o.weights):
        o.add_weight(1)
    while o.weights:
        o.add_weight(0)
    return [a for a in o.ops if a.microbatch < m]


def zbv(stages: int, microbatches: int) -> Schedule:
    """ZBV (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 6): two chunks per rank in a V, backward split
    into BI and W; with tF = tB = tW per chunk its bubble is (p-1)(tF+tB-2tW) = 0 beyond the p-1 slots of the fill
    (see `closed_form_bubble`), and every rank stashes at most 2p chunk activations, 1F1B's p full-stage ones."""
    p, m = stages, microbatches
    check_request("zbv", p, m)
    return v_schedule("zbv", p, m, [_zbv_order(r, p, m) for r in range(p)])


def _dualpipev_order(rank: int, p: int, m: int) -> list[Action]:
    """DualPipeV's compute order on `rank` (DeepSeek's DualPipe repository, as torch.distributed.pipelining orders it)."""
    o = _Order(rank, p)
    for _ in range(2 * (p - rank - 1)):  # 1: chunk 0 forwards
        o.add(0, Kind.FORWARD)
    for _ in range(rank + 1):  # 2: F0 F1
        o.add(0, Kind.FORWARD)
        o.add(1, Kind.FORWARD)
    for _ in range(p - rank - 1):  # 3: B1 W F1, zero bubble
        o.add(1, Kind.BACKWARD_INPUT)
        o.add_weight()
        o.add(1, Kind.FORWARD)
    for _ in range(m - 2 * p + rank + 1):  # 4, the main step: (F0 with B1) then (F1 with B0)
        o.add(0, Kind.FORWARD)
        o.add(1, Kind.BACKWARD)
        o.add(1, Kind.FORWARD)
        o.add(0, Kind.BACKWARD)
    for _ in range(p - rank - 1):  # 5: B1, (F1 with B0)
        o.add(1, Kind.BACKWARD)
        o.add(1, Kind.FORWARD)
        o.add(0, Kind.BACKWARD)
    split = False
    for i in range(rank + 1):  # 6: B1 B0, the second half with split backwards
        split |= i == (rank + 1) // 2 and rank % 2 == 1
        o.add(1, Kind.BACKWARD_INPUT if split else Kind.BACKWARD)
        split |= i == (rank + 1) // 2 and rank % 2 == 0
        o.add(0, Kind.BACKWARD_INPUT if split else Kind.BACKWARD)
    for _ in range(p - rank - 1):  # 7: W B0
        o.add_weight()
        o.add(0, Kind.BACKWARD_INPUT if split else Kind.BACKWARD)
    while o.weights:  # 8: the remaining weight passes
        o.add_weight()
    return o.ops


def dualpipev(stages: int, microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek-V3, 2024; the V-folded DualPipe): two chunks per rank in a V, m >= 2p micro-batches, steady
    state pairing one chunk's forward with the other chunk's full backward; split backwards only where they fill the
    cool-down. Bubble (p-1)(tF&B + tB - 3tW) in DeepSeek's accounting; `simulate` gives this construction's exactly."""
    p, m = stages, microbatches
    check_request("dualpipev", p, m)
    return v_schedule("dualpipev", p, m, [_dualpipev_order(r, p, m) for r in range(p)])
