"""A model of NCCL's point-to-point semantics, to prove a schedule's transfers, as the executor issues them, never hang.

`validate` already proves a schedule deadlock-free when sends are buffered (gloo-like). NCCL is
stricter, and this check runs the schedule's communication under its rules:

- a rank issues groups of sends and receives (one `batch_isend_irecv` each, or one lone isend/irecv);
  the groups of one communicator run on one stream, one after another, in issue order; a group is
  *active* while it is the oldest unfinished group of its stream;
- messages between two ranks are matched by order, not by tag: the k-th send from a to b pairs with
  the k-th receive on b from a (per direction); if they carry different tensors, that is an error;
- rendezvous, no buffering: a send and its receive complete together, once both their groups are
  active; a group finishes when all its transfers have;
- the host issues groups in its action order and blocks where it waits: at a RECV (until the
  receive's whole group finishes, since NCCL reports a group as one work), in a GRAD_SYNC (an
  exchange group issued and waited at once), and at OPT_STEP (until all its groups finished).
  On a GPU the host does not block; the compute stream does, and later groups wait for it, which
  orders the same events the same way.

The check either finishes every rank or raises ScheduleError naming each stuck rank, the transfer
its stream is stuck on and what that transfer's match on the peer is queued behind.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

from behemoth.parallel.pipeline.p2p_groups import P2PGroup, message_key, p2p_groups, reference_timeline
from behemoth.parallel.pipeline.schedules import COMPUTE, RECVS, SENDS, Action, Kind, Schedule, ScheduleError

GroupPlan = Callable[[Schedule, int], list[P2PGroup]]  # (schedule, rank) -> that rank's groups, in issue order


@dataclass
class _Op:
    """One send or receive as issued, and the op on the peer it pairs with."""

    rank: int
    index: int  # the action's index in the rank's list
    send: bool
    peer: int
    key: tuple[int, int, int]
    group: int
    partner: int | None = None
    done: bool = False


@dataclass
class _Group:
    rank: int
    stream: tuple[int, int | None]  # (rank, None: the process group's communicator; a peer: a two-rank one)
    ops: list[int]
    done: bool = False


class _Rendezvous:
    """Issues every rank's groups in action order and completes transfers by NCCL's rules until all finish or none can move."""

    def __init__(self, schedule: Schedule, plan: GroupPlan) -> None:
        self.s = schedule
        self.ops: list[_Op] = []
        self.groups: list[_Group] = []
        self.streams: defaultdict[tuple[int, int | None], deque[int]] = defaultdict(deque)
        self.issued: Counter[tuple[int, int, bool]] = Counter()  # (src, dst, is_send) -> transfers issued
        self.waiting: dict[tuple[int, int, int, bool], int] = {}  # (src, dst, seq, is_send) -> op not yet paired
        self.programs = [self._program(rank, actions, plan(schedule, rank)) for rank, actions in enumerate(schedule.per_rank)]
        self.pc = [0] * schedule.ranks
        self.unfinished = Counter(g.rank for g in self.groups)  # rank -> its groups not yet finished

    def _new_group(self, rank: int, stream: int | None, ops: list[tuple[int, bool, int, tuple]]) -> int:
        gid = len(self.groups)
        self.groups.append(_Group(rank, (rank, stream), []))
        for index, send, peer, key in ops:
            self.groups[gid].ops.append(len(self.ops))
            self.ops.append(_Op(rank, index, send, peer, key, gid))
        return gid

    def _program(self, rank: int, actions: list[Action], plan: list[P2PGroup]) -> list[tuple[str, int, int]]:
        """The rank's host events: ("issue", group, index), ("wait", group, index), ("end", -1, index)."""
        issue_at: defaultdict[int, list[int]] = defaultdict(list)
        group_of: dict[int, int] = {}
        compute = [i for i, a in enumerate(actions) if a.kind in COMPUTE]
        for g in plan:
            for j in g.ops:
                self._check_placement(rank, actions, compute, g.at, j, group_of)
            ops = [(j, actions[j].kind in SENDS, actions[j].peer, message_key(actions[j])) for j in g.ops]
            gid = self._new_group(rank, g.stream, ops)
            issue_at[g.at].append(gid)
            group_of.update((j, gid) for j in g.ops)
        steps: list[tuple[str, int, int]] = []
        for i, a in enumerate(actions):
            steps += [("issue", gid, i) for gid in issue_at[i]]
            if a.kind in SENDS or a.kind in RECVS:
                if i not in group_of:
                    raise ScheduleError(f"schedule {self.s.name}: rank {rank}'s action {i} {a} is in no p2p group")
                if a.kind in RECVS:
                    steps.append(("wait", group_of[i], i))
            elif a.kind is Kind.GRAD_SYNC:  # pair_all_reduce: one group exchanging the stage's gradients
                key = (2, a.stage, -1)
                gid = self._new_group(rank, None, [(i, True, a.peer, key), (i, False, a.peer, key)])
                steps += [("issue", gid, i), ("wait", gid, i)]
            elif a.kind is Kind.OPT_STEP:
                steps.append(("end", -1, i))
        return steps

    def _check_placement(self, rank: int, actions: list[Action], compute: list[int], at: int, j: int, group_of: dict[int, int]) -> None:
        """A transfer sits in one group; a send's group goes out after its producer, a receive's by its RECV action."""
        a = actions[j]
        passes = bisect.bisect_left(compute, j) - bisect.bisect_left(compute, at)  # passes between the issue and action j
        problem = (
            "is in two groups"
            if j in group_of
            else "is not a transfer"
            if a.kind not in SENDS and a.kind not in RECVS
            else "is issued before the pass that produces it"
            if a.kind in SENDS and (passes or at > j)
            else "is posted after its RECV action"
            if at > j
            else None
        )
        if problem is not None:
            raise ScheduleError(f"schedule {self.s.name}: rank {rank}'s action {j} {a}, grouped before action {at}, {problem}")

    def _issue(self, gid: int) -> None:
        """Queue the group on its stream and pair each transfer with the same-numbered one on its peer."""
        g = self.groups[gid]
        self.streams[g.stream].append(gid)
        for o in g.ops:
            op = self.ops[o]
            src, dst = (op.rank, op.peer) if op.send else (op.peer, op.rank)
            seq = self.issued[(src, dst, op.send)]
            self.issued[(src, dst, op.send)] += 1
            other = self.waiting.pop((src, dst, seq, not op.send), None)
            if other is None:
                self.waiting[(src, dst, seq, op.send)] = o
                continue
            op.partner, self.ops[other].partner = other, o
            if self.ops[other].key != op.key:
                send, recv = (op, self.ops[other]) if op.send else (self.ops[other], op)
                raise ScheduleError(
                    f"schedule {self.s.name} mismatches under NCCL's in-order matching: rank {src}'s send #{seq} to rank {dst} "
                    f"is {self.describe(send)} but rank {dst}'s receive #{seq} from rank {src} is {self.describe(recv)}",
                    "issue the transfers of a pair in the same order on both ranks",
                )

    def describe(self, op: _Op) -> str:
        a = self.s.per_rank[op.rank][op.index]
        if a.kind is Kind.GRAD_SYNC:
            return f"{'send' if op.send else 'receive'} of GRAD_SYNC(stage={a.stage}, with rank {a.peer})"
        return str(a)

    def _active(self, gid: int) -> bool:
        stream = self.streams[self.groups[gid].stream]
        return bool(stream) and stream[0] == gid

    def _advance(self, rank: int) -> bool:
        """Run the rank's host events until one blocks; True if any ran."""
        moved, steps = False, self.programs[rank]
        while self.pc[rank] < len(steps):
            what, gid, _ = steps[self.pc[rank]]
            if what == "issue":
                self._issue(gid)
            elif what == "wait" and not self.groups[gid].done:
                break
            elif what == "end" and self.unfinished[rank]:
                break
            self.pc[rank] += 1
            moved = True
        return moved

    def _complete(self) -> bool:
        """Complete every transfer whose group and whose partner's group are active; retire finished groups."""
        moved = False
        for stream in list(self.streams.values()):
            if not stream:
                continue
            for o in self.groups[stream[0]].ops:
                op = self.ops[o]
                if not op.done and op.partner is not None and self._active(self.ops[op.partner].group):
                    op.done = self.ops[op.partner].done = True
            while stream and all(self.ops[o].done for o in self.groups[stream[0]].ops):
                finished = self.groups[stream.popleft()]
                finished.done = moved = True
                self.unfinished[finished.rank] -= 1
        return moved

    def run(self) -> int:
        while sum([self._advance(r) for r in range(self.s.ranks)]) + self._complete():
            pass
        stuck = [r for r in range(self.s.ranks) if self.pc[r] < len(self.programs[r])]
        if stuck:
            raise ScheduleError(
                f"schedule {self.s.name} deadlocks under NCCL's rendezvous p2p, its transfers grouped as issued: "
                + "; ".join(self._why(r) for r in stuck),
                "post the receives in another order (p2p_groups)",
            )
        return sum(op.send and op.done for op in self.ops)

    def _why(self, rank: int) -> str:
        """`rank 0 waits at action 5 RECV_GRAD(...): its stream is stuck at X, whose match on rank 1 is queued behind Y`."""
        what, gid, index = self.programs[rank][self.pc[rank]]
        where = f"rank {rank} waits at action {index} {self.s.per_rank[rank][index]}"
        streams = [self.groups[gid].stream] if what == "wait" else [k for k, q in self.streams.items() if k[0] == rank and q]
        for stream in streams:
            head = self.streams[stream][0]
            op = next(self.ops[o] for o in self.groups[head].ops if not self.ops[o].done)
            if op.partner is None:
                return f"{where}: its stream is stuck at {self.describe(op)}, which rank {op.peer} has not issued yet"
            theirs = self.ops[op.partner]
            blocker = next(self.ops[o] for o in self.groups[self.streams[self.groups[theirs.group].stream][0]].ops if not self.ops[o].done)
            return f"{where}: its stream is stuck at {self.describe(op)}, whose match on rank {op.peer} is queued behind {self.describe(blocker)}"
        return where


def check_rendezvous(schedule: Schedule, plan: GroupPlan | None = None) -> int:
    """Prove `schedule`'s transfers, grouped by `plan` (the executor's), complete and correctly matched under NCCL's rules.

    Returns how many transfers completed (every send, paired with its receive); raises `ScheduleError` otherwise."""
    if plan is None:
        timeline = reference_timeline(schedule)
        plan = lambda s, rank: p2p_groups(s, rank, timeline=timeline)  # noqa: E731
    return _Rendezvous(schedule, plan).run()
