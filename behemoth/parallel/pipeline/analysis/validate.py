"""Proof that a schedule is complete and deadlock-free, before any process runs it.

`validate` checks, in order: every action names a stage, micro-batch, chunk and peer that exist
and belong to its rank; every micro-batch's forward runs exactly once on every stage and its
backward (or input-gradient and weight-gradient passes) exactly once; on each rank every pass
comes after what it consumes (its forward, its received or locally produced input or gradient);
every send is matched by exactly one receive of the same (payload, stage, microbatch) on its peer
and vice versa; Chimera's gradient syncs pair the two replicas of each stage after their last
backward; the optimizer step is each rank's last action; the simulated execution terminates with
buffered sends; and the transfers, batched as the executor issues them (`p2p_groups`), complete
and pair the right tensors under NCCL's rendezvous, in-order semantics (`rendezvous.py`).
"""

from __future__ import annotations

from collections import Counter, defaultdict

from behemoth.parallel.pipeline.analysis.rendezvous import check_rendezvous
from behemoth.parallel.pipeline.analysis.simulate import run_timeline
from behemoth.parallel.pipeline.schedules import BACKWARDS, COMPUTE, RECVS, SENDS, Action, Kind, Schedule, ScheduleError


def _fail(schedule: Schedule, rank: int, index: int | None, problem: str) -> ScheduleError:
    """An error naming the schedule, the rank, the action index and the problem."""
    where = f"rank {rank}" if index is None else f"rank {rank}, action {index} {schedule.per_rank[rank][index]}"
    return ScheduleError(f"schedule {schedule.name} is invalid: {where}: {problem}")


def _local_stage(a: Action) -> int:
    """The stage on this rank that an action serves: a receive serves the stage that consumes the tensor."""
    return a.stage + {Kind.RECV_ACT: 1, Kind.RECV_GRAD: -1}.get(a.kind, 0)


def _placement_problem(s: Schedule, rank: int, a: Action) -> str | None:
    """Why `a` cannot be an action of `rank` (a stage, micro-batch, chunk or peer that does not fit), or None."""
    if a.kind is Kind.OPT_STEP:
        return None
    if not 0 <= a.stage < s.num_stages:
        return f"stage {a.stage} is outside 0..{s.num_stages - 1}"
    if a.kind is not Kind.GRAD_SYNC and not 0 <= a.microbatch < s.microbatches:
        return f"micro-batch {a.microbatch} is outside 0..{s.microbatches - 1}"
    if a.kind is Kind.GRAD_SYNC:
        others = [r for r in s.stage_ranks[a.stage] if r != rank]
        if others != [a.peer]:
            return f"stage {a.stage}'s other replica is on ranks {others}, not {a.peer}"
    elif a.kind in COMPUTE:
        if (owner := s.rank_of(a.stage, a.microbatch)) != rank:
            return f"stage {a.stage} runs micro-batch {a.microbatch} on rank {owner}"
    elif (problem := _p2p_problem(s, rank, a)) is not None:
        return problem
    chunks = s.chunk_stages[rank]
    if not 0 <= a.chunk < len(chunks) or chunks[a.chunk] != _local_stage(a):
        return f"chunk {a.chunk} is not stage {_local_stage(a)} on rank {rank} (its chunks hold stages {list(chunks)})"
    return None


def _p2p_problem(s: Schedule, rank: int, a: Action) -> str | None:
    """Why a send or receive goes between the wrong ranks, or None."""
    step = 1 if a.kind in (Kind.SEND_ACT, Kind.RECV_ACT) else -1  # activations flow up the stages, gradients down
    if not 0 <= a.stage + step < s.num_stages:
        return f"stage {a.stage} has no stage {a.stage + step} to exchange with"
    src, dst = s.rank_of(a.stage, a.microbatch), s.rank_of(a.stage + step, a.microbatch)
    me, peer = (src, dst) if a.kind in SENDS else (dst, src)
    if (rank, a.peer) != (me, peer):
        return f"this transfer goes from rank {src} to rank {dst}"
    return "sender and receiver are the same rank; hand the tensor over locally" if src == dst else None


def _check_placement(s: Schedule) -> None:
    if len(s.per_rank) != s.ranks:
        raise ScheduleError(f"schedule {s.name} is invalid: {len(s.per_rank)} action lists for {s.ranks} ranks")
    for rank, actions in enumerate(s.per_rank):
        for index, a in enumerate(actions):
            if (problem := _placement_problem(s, rank, a)) is not None:
                raise _fail(s, rank, index, problem)


def _check_complete(s: Schedule) -> None:
    """Every (stage, microbatch) has one forward and one backward (or, in a split schedule, one BI and one W), nothing
    twice; at most one recomputation."""
    seen: dict[tuple[Kind, int, int], tuple[int, int]] = {}
    for rank, actions in enumerate(s.per_rank):
        for index, a in enumerate(actions):
            key = (a.kind, a.stage, a.microbatch)
            if a.kind in COMPUTE and key in seen:
                raise _fail(s, rank, index, f"repeats action {seen[key][1]} on rank {seen[key][0]}")
            seen[key] = (rank, index)
    unwanted = set() if s.split_backward else {Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT}  # a split one may also run B
    for (kind, stage, mb), (rank, index) in seen.items():
        if kind in unwanted:
            raise _fail(s, rank, index, f"a full-backward schedule cannot run {kind.name}")
        if kind is Kind.BACKWARD and {(Kind.BACKWARD_INPUT, stage, mb), (Kind.BACKWARD_WEIGHT, stage, mb)} & seen.keys():
            raise _fail(s, rank, index, f"runs both a full and a split backward of stage {stage}, micro-batch {mb}")
    for stage in range(s.num_stages):
        for mb in range(s.microbatches):
            split = s.split_backward and (Kind.BACKWARD, stage, mb) not in seen
            for kind in [Kind.FORWARD] + ([Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT] if split else [Kind.BACKWARD]):
                if (kind, stage, mb) not in seen:
                    raise _fail(s, s.rank_of(stage, mb), None, f"never runs {kind.name} of stage {stage}, micro-batch {mb}")


def _requirements(s: Schedule, rank: int, a: Action) -> list[tuple[frozenset[Kind], int, str]]:
    """What must already be on `rank` before `a`: (any of these kinds, at this stage, described), same micro-batch."""
    st, mb = a.stage, a.microbatch
    if a.kind is Kind.FORWARD and st > 0:
        if s.rank_of(st - 1, mb) == rank:
            return [(frozenset({Kind.FORWARD}), st - 1, "the previous stage's forward that makes its input")]
        return [(frozenset({Kind.RECV_ACT}), st - 1, "the receive of its input activation")]
    if a.kind in BACKWARDS:
        needs = [(frozenset({Kind.FORWARD}), st, "its forward")]
        if st < s.num_stages - 1 and s.rank_of(st + 1, mb) == rank:
            needs.append((BACKWARDS, st + 1, "the backward of the next stage that makes its output gradient"))
        elif st < s.num_stages - 1:
            needs.append((frozenset({Kind.RECV_GRAD}), st + 1, "the receive of its output gradient"))
        return needs
    if a.kind is Kind.BACKWARD_WEIGHT:
        return [(frozenset({Kind.BACKWARD_INPUT}), st, "its input-gradient pass")]
    if a.kind is Kind.RECOMPUTE:
        return [(frozenset({Kind.FORWARD}), st, "the forward it repeats")]
    if a.kind is Kind.SEND_ACT:
        return [(frozenset({Kind.FORWARD}), st, "the forward that makes the activation")]
    if a.kind is Kind.SEND_GRAD:
        return [(BACKWARDS, st, "the backward that makes the gradient")]
    return []


def _runs_here(s: Schedule, rank: int, stage: int) -> int:
    """How many micro-batches `rank` runs through `stage`."""
    return sum(s.rank_of(stage, mb) == rank for mb in range(s.microbatches))


def _check_order(s: Schedule) -> None:
    """On each rank, every action comes after what it consumes; syncs after the stage's last backward; OPT_STEP last."""
    release = {Kind.BACKWARD_WEIGHT, Kind.BACKWARD} if s.split_backward else {Kind.BACKWARD}
    for rank, actions in enumerate(s.per_rank):
        done: set[tuple[Kind, int, int]] = set()
        finished: Counter[int] = Counter()  # stage -> micro-batches whose last backward pass ran here
        again = {(a.stage, a.microbatch) for a in actions if a.kind is Kind.RECOMPUTE}
        for index, a in enumerate(actions):
            for kinds, stage, what in _requirements(s, rank, a):
                if not any((k, stage, a.microbatch) in done for k in kinds):
                    raise _fail(s, rank, index, f"comes before {what} (stage {stage})")
            if a.kind in BACKWARDS and (a.stage, a.microbatch) in again and (Kind.RECOMPUTE, a.stage, a.microbatch) not in done:
                raise _fail(s, rank, index, f"comes before the recomputation of its activations (stage {a.stage})")
            if a.kind is Kind.GRAD_SYNC and finished[a.stage] < (owned := _runs_here(s, rank, a.stage)):
                raise _fail(s, rank, index, f"syncs stage {a.stage} after {finished[a.stage]} of its {owned} backward passes")
            if a.kind is Kind.OPT_STEP and index != len(actions) - 1:
                raise _fail(s, rank, index, "the optimizer step must be the rank's last action")
            done.add((a.kind, a.stage, a.microbatch))
            finished[a.stage] += a.kind in release
        if not actions or actions[-1].kind is not Kind.OPT_STEP:
            raise _fail(s, rank, None, "does not end with the optimizer step")


def _check_matching(s: Schedule) -> None:
    """Every send has exactly one receive of the same (payload, stage, microbatch) on its peer, and back."""
    sends: defaultdict[tuple, list[tuple[int, int]]] = defaultdict(list)
    recvs: defaultdict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for rank, actions in enumerate(s.per_rank):
        for index, a in enumerate(actions):
            if a.kind in SENDS:
                sends[(SENDS[a.kind], a.stage, a.microbatch, rank, a.peer)].append((rank, index))
            elif a.kind in RECVS:
                recvs[(a.kind, a.stage, a.microbatch, a.peer, rank)].append((rank, index))
    for mine, theirs, verb in ((sends, recvs, "receives"), (recvs, sends, "sends")):
        for (kind, stage, mb, src, dst), where in mine.items():
            if len(where) > 1:
                raise _fail(s, *where[1], f"repeats action {where[0][1]}: one tensor, one transfer")
            if (kind, stage, mb, src, dst) not in theirs:
                peer = dst if verb == "receives" else src
                raise _fail(s, *where[0], f"rank {peer} never {verb} it")


def _check_syncs(s: Schedule) -> None:
    """Each replica of a replicated stage syncs its gradients with the other exactly once."""
    syncs = Counter((rank, a.stage) for rank, actions in enumerate(s.per_rank) for a in actions if a.kind is Kind.GRAD_SYNC)
    for stage, ranks in enumerate(s.stage_ranks):
        for rank in ranks if len(ranks) > 1 else ():
            if syncs[(rank, stage)] != 1:
                raise _fail(s, rank, None, f"has {syncs[(rank, stage)]} GRAD_SYNC of stage {stage}, needs exactly 1")


def validate(schedule: Schedule) -> None:
    """Prove `schedule` complete, consistent and deadlock-free; raise ScheduleError naming rank, action and problem."""
    _check_placement(schedule)
    _check_complete(schedule)
    _check_order(schedule)
    _check_matching(schedule)
    _check_syncs(schedule)
    run_timeline(schedule)  # terminates, or raises naming every stuck rank and its action
    check_rendezvous(schedule)  # and so do the executor's batched transfers under NCCL's rules
