"""The receive buffers a pipeline rank keeps from step to step (parallel/pipeline/buffers.py), counted off its schedule.

Every receive lands in a kept buffer of its shape (activations and gradients between stages have one shape: a
micro-batch's hidden states), taken when its p2p group is issued (up to `RECV_LOOKAHEAD` passes before the pass that
consumes it, `p2p_groups`) and free again once nothing holds it: once the consuming stage's backward of that
micro-batch has run (autograd saved a received activation in forward; a backward consumes a received gradient), or
under a split backward its weight pass (which keeps both; measured). A rank keeps as many buffers as were taken and not
yet free at once, for the whole step; they hold every received tensor, so the stash's received stage inputs are
part of them, not allocations of their own.
"""

from __future__ import annotations

from functools import lru_cache

from behemoth.parallel.pipeline.actions import BACKWARDS, RECVS, Action, Kind
from behemoth.parallel.pipeline.p2p_groups import RECV_LOOKAHEAD, P2PGroup, p2p_groups, reference_timeline
from behemoth.parallel.pipeline.schedules import build_schedule

RELEASING = BACKWARDS | {Kind.BACKWARD_WEIGHT}
LISTED_RANK_ACTIONS = 4_000  # a schedule with at most this many actions per rank has its slots counted off its lists


def receive_slots(name: str, p: int, m: int, v: int, rank: int) -> int:
    """Kept receive buffers of pipeline rank `rank` under schedule `name` (p ranks, m micro-batches, v chunks): the
    most receives taken and not yet free at once in a step."""
    return schedule_slots(name, p, m, v)[rank]


@lru_cache(maxsize=256)
def schedule_slots(name: str, p: int, m: int, v: int) -> tuple[int, ...]:
    """`receive_slots` of every rank, off one build of the schedule and one reference timeline (the search asks for
    every rank of the same schedules over and over)."""
    schedule = build_schedule(name, p, m, v)
    timeline = reference_timeline(schedule)
    return tuple(rank_slots(schedule.per_rank[rank], p2p_groups(schedule, rank, RECV_LOOKAHEAD, timeline)) for rank in range(p))


def rank_slots(actions: list[Action], groups: list[P2PGroup]) -> int:
    """The most receives of one rank's list taken (when their group is issued) and not yet free at once."""
    last: dict[tuple[int, int], int] = {}  # (stage, micro-batch) -> index of its last backward or weight pass
    for i, a in enumerate(actions):
        if a.kind in RELEASING:
            last[a.stage, a.microbatch] = i
    events: list[tuple[int, int]] = []
    for group in groups:
        for j in group.ops:
            recv = actions[j]
            if recv.kind in RECVS:
                stage = recv.stage + 1 if recv.kind is Kind.RECV_ACT else recv.stage - 1
                events += [(group.at, 1), (last.get((stage, recv.microbatch), len(actions)) + 1, -1)]
    alive = most = 0
    for _, change in sorted(events):  # at one index a release (-1) comes before a take (+1)
        alive += change
        most = max(most, alive)
    return most


def closed_slots(name: str, p: int, m: int, rank: int) -> int:
    """`receive_slots` of a long pipeline, bounded: the micro-batches a rank holds at once (the first stage receives
    only gradients, the last only activations) and the receives posted ahead."""
    return min(m, p - rank + RECV_LOOKAHEAD) * (2 if name in ("zbv", "dualpipev", "interleaved", "chimera") else 1)


def kept_receives(name: str, p: int, m: int, v: int, rank: int) -> int:
    """Kept receive buffers of rank `rank`: listed for a schedule of bounded length, else `closed_slots`."""
    if p == 1:
        return 0
    if p * m * v * 6 <= LISTED_RANK_ACTIONS:
        return receive_slots(name, p, m, v, rank)
    return closed_slots(name, p, m, rank)
