"""How the executor batches a rank's transfers into `batch_isend_irecv` groups that NCCL cannot deadlock on.

NCCL runs every batched send and receive of a communicator on one stream, in issue order; a send
completes only when its peer's matching receive runs (rendezvous, no buffering); and messages
between two ranks are matched by order, not by tag. An executor that posts receives early, one at
a time, can queue a receive ahead of a send its peer is waiting for, and both ranks hang (1F1B's
steady state does exactly that). A fixed pairing is not enough either: Megatron's "send the last
pass's output with the receive of the next pass's input" deadlocks interleaved 1F1B's chunk
boundaries. So the grouping follows the schedule's own timeline.

Every message gets a place in one order that all ranks share: (time, payload, stage, micro-batch),
the time being when its SEND runs in the schedule's reference timeline (`reference_timeline`:
buffered sends, a backward twice a forward as on real hardware, so receives are posted about when
their messages really come; `validate` proves it terminates), activations before gradients. On each
rank, a slot is the gap before its s-th compute pass (slot n: after the last). Then:

- a SEND joins the slot right after the pass that produces it;
- a RECV joins the slot after the rank's last pass that ends by its message's time ("post it when
  the message exists"), or earlier, up to `lookahead` passes before its consumer, so the transfer
  travels while the rank computes; but never before one of the rank's own sends that comes earlier
  in the order, nor before a receive that does;
- transfers of one slot and one time form one group, in the shared order; groups go out in (slot,
  time) order. A receive never lands after an own send later in the order (that send's pass ends
  after the message exists, or when it does, and then both share a group), so every rank issues
  all its transfers in the shared order. One time per group keeps a wait for a
  receive (NCCL reports a group as one work) from also waiting for a later send.

Why this cannot hang under NCCL (`rendezvous.py` runs the model for every schedule): the order
respects causality (a pass's inputs are sent before it starts in the reference, its outputs when it
ends), so each rank can issue in it. Take the earliest unfinished transfer x. Everything either of
its ranks issued before x is earlier in the order, hence finished; a host waits only for groups it
has issued, so both hosts got past every wait before x and issued x, and x's groups are at the
heads of both streams: x completes. Both ranks of a pair issue the messages they exchange in the
shared order, so NCCL's in-order matching pairs the right tensors. (Chimera's gradient syncs come
after all of a rank's transfers, in stage order on both replicas: last in the order.)

A receive is still waited for only when its RECV action runs, right before its consumer.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from behemoth.parallel.pipeline.analysis.simulate import Costs, Interval, run_timeline
from behemoth.parallel.pipeline.schedules import COMPUTE, RECVS, SENDS, Action, Kind, Schedule

RECV_LOOKAHEAD = 4  # a receive may be posted up to this many passes before its consumer (one buffer each, held early)
REFERENCE_COSTS = Costs(forward=1.0, backward=1.0, weight=1.0)  # F = BI = W = 1, a full backward B = 2


def reference_timeline(schedule: Schedule) -> list[list[Interval]]:
    """The timeline whose send times order every rank's transfers (any terminating one would do; this one is realistic)."""
    return run_timeline(schedule, REFERENCE_COSTS)


@dataclass(frozen=True)
class P2PGroup:
    """Transfers issued together in one batch_isend_irecv, just before action `at` of the rank's list.

    `ops` are indices of SEND/RECV actions in that list. `stream` is None for a batched group (NCCL:
    the process group's communicator and stream); a peer's rank for a lone op on the dedicated
    two-rank communicator PyTorch's NCCL backend uses for an unbatched isend/irecv.
    """

    at: int
    ops: tuple[int, ...]
    stream: int | None = None


def message_key(a: Action) -> tuple[int, int, int]:
    """The identity of the tensor a SEND or RECV carries: (payload, producing stage, micro-batch)."""
    payload = 0 if a.kind in (Kind.SEND_ACT, Kind.RECV_ACT) else 1
    return payload, a.stage, a.microbatch


def message_order(timeline: list[list[Interval]]) -> dict[tuple[int, int, int], tuple[float, int, int, int]]:
    """Message key -> its place in the order every rank issues transfers in: (send time in `timeline`, payload, stage,
    micro-batch); activations before gradients sent at the same time."""
    return {message_key(i.action): (i.start, *message_key(i.action)) for row in timeline for i in row if i.action.kind in SENDS}


def p2p_groups(schedule: Schedule, rank: int, lookahead: int = RECV_LOOKAHEAD, timeline: list[list[Interval]] | None = None) -> list[P2PGroup]:
    """The groups, in issue order, in which the executor issues `rank`'s sends and receives.

    `timeline` is the reference (`reference_timeline(schedule)`); pass it to group several ranks without rerunning it.
    """
    actions = schedule.per_rank[rank]
    timeline = reference_timeline(schedule) if timeline is None else timeline
    order = message_order(timeline)
    compute = [i for i, a in enumerate(actions) if a.kind in COMPUTE]
    ends = [i.end for i in timeline[rank] if i.action.kind in COMPUTE]
    slots: dict[int, int] = {}  # action index -> slot
    send_orders, send_slots = [], []  # this rank's sends, in action order (both rise)
    for j, a in enumerate(actions):
        if a.kind in SENDS:
            slots[j] = bisect.bisect(compute, j)  # right after its producer, compute[slot - 1]
            send_orders.append(order[message_key(a)])
            send_slots.append(slots[j])
    earliest = 0
    for j in sorted((j for j, a in enumerate(actions) if a.kind in RECVS), key=lambda j: order[message_key(actions[j])]):
        mine = order[message_key(actions[j])]
        exists = bisect.bisect_right(ends, mine[0])  # passes of this rank that end by the time the message is sent
        before = bisect.bisect_left(send_orders, mine)  # this rank's sends that come earlier in the order
        earliest = max(earliest, send_slots[before - 1] if before else 0, min(exists, bisect.bisect(compute, j) - lookahead))
        slots[j] = earliest
    groups: dict[tuple[int, float], list[int]] = {}
    for j in sorted(slots, key=lambda j: order[message_key(actions[j])]):
        groups.setdefault((slots[j], order[message_key(actions[j])][0]), []).append(j)
    return [P2PGroup(compute[slot - 1] + 1 if slot else 0, tuple(ops)) for (slot, _), ops in sorted(groups.items())]
