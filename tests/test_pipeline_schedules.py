"""Pipeline schedules as data: validated, simulated against the published closed forms, printed and reported."""

from __future__ import annotations

import bisect
import dataclasses
import math

import pytest

from behemoth.errors import BehemothError
from behemoth.parallel.pipeline import (
    SCHEDULES,
    Action,
    Costs,
    Kind,
    Schedule,
    ScheduleError,
    build_schedule,
    chimera,
    closed_form_bubble,
    gpipe,
    interleaved,
    one_f_one_b,
    run_timeline,
    simulate,
    validate,
    zb_h1,
)
from behemoth.parallel.pipeline.analysis.gantt import format_grid
from behemoth.parallel.pipeline.analysis.rendezvous import check_rendezvous
from behemoth.parallel.pipeline.analysis.report import compare, schedule_main
from behemoth.parallel.pipeline.p2p_groups import P2PGroup, message_key, p2p_groups
from behemoth.parallel.pipeline.schedules import COMPUTE, RECVS, SENDS


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)


def editable(schedule: Schedule) -> Schedule:
    """A copy whose action lists a test may break."""
    return dataclasses.replace(schedule, per_rank=[list(actions) for actions in schedule.per_rank])


def index_of(actions: list[Action], kind: Kind, stage: int, microbatch: int) -> int:
    return next(i for i, a in enumerate(actions) if (a.kind, a.stage, a.microbatch) == (kind, stage, microbatch))


# ---------------------------------------------------------------- the validator accepts every schedule


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_buildable_schedule_validates(name):
    built = 0
    for p in (1, 2, 3, 4, 8):
        for m in range(1, 17):
            for v in (2, 3, 4) if name == "interleaved" else (1,):
                try:
                    schedule = build_schedule(name, p, m, v)
                except ScheduleError:
                    continue
                validate(schedule)
                built += 1
    assert built >= {"interleaved": 40, "chimera": 14, "dualpipev": 40}.get(name, 80), f"only {built} {name} configurations were built"


def test_actions_carry_what_an_executor_needs():
    s = chimera(4, 8)
    assert s.rank_of(1, 0) == 1 and s.rank_of(1, 4) == 2, "down micro-batches run stage s on rank s, up ones on D-1-s"
    for rank, actions in enumerate(s.per_rank):
        for a in actions:
            if a.kind in (Kind.FORWARD, Kind.BACKWARD):
                assert s.chunk_stages[rank][a.chunk] == a.stage
    single_rank = interleaved(1, 3, 2)  # both chunks on one rank: handed over locally, no p2p
    assert {a.kind for a in single_rank.per_rank[0]} == {Kind.FORWARD, Kind.BACKWARD, Kind.OPT_STEP}
    first = one_f_one_b(2, 2).per_rank[0][:2]
    assert first == [Action(Kind.FORWARD, 0, 0, 0), Action(Kind.SEND_ACT, 0, 0, 0, peer=1)]


# ---------------------------------------------------------------- the validator rejects broken schedules


def test_validator_catches_a_dropped_send():
    s = editable(one_f_one_b(4, 8))
    del s.per_rank[0][index_of(s.per_rank[0], Kind.SEND_ACT, 0, 3)]
    recv = index_of(s.per_rank[1], Kind.RECV_ACT, 0, 3)
    with pytest.raises(ScheduleError, match=rf"rank 1, action {recv} RECV_ACT\(stage=0, mb=3, from rank 0\): rank 0 never sends it"):
        validate(s)


def test_validator_catches_a_deadlock_from_a_late_send():
    s = editable(one_f_one_b(2, 4))
    rank0 = s.per_rank[0]
    send = rank0.pop(index_of(rank0, Kind.SEND_ACT, 0, 0))
    rank0.insert(index_of(rank0, Kind.BACKWARD, 0, 0) + 1, send)  # statically fine: still after its forward
    with pytest.raises(
        ScheduleError,
        match=r"deadlocks: rank 0 waits at action \d+ RECV_GRAD\(stage=1, mb=0, from rank 1\); "
        r"rank 1 waits at action 0 RECV_ACT\(stage=0, mb=0, from rank 0\)",
    ):
        validate(s)


def test_validator_catches_swapped_gradient_syncs():
    s = editable(chimera(2, 2))
    rank0 = s.per_rank[0]
    rank0[-3], rank0[-2] = rank0[-2], rank0[-3]  # rank 0 syncs stage 1 first, rank 1 stage 0 first
    with pytest.raises(ScheduleError, match=r"rank 0 waits at action \d+ GRAD_SYNC\(stage=1, with rank 1\); rank 1 waits"):
        validate(s)


def test_validator_catches_backward_before_forward():
    s = editable(gpipe(2, 2))
    last = s.per_rank[1]
    f, b = index_of(last, Kind.FORWARD, 1, 0), index_of(last, Kind.BACKWARD, 1, 0)
    last[f], last[b] = last[b], last[f]
    with pytest.raises(ScheduleError, match=rf"rank 1, action {f} B\(stage=1, mb=0\): comes before its forward"):
        validate(s)


def test_validator_catches_missing_and_repeated_passes():
    s = editable(zb_h1(2, 3))
    s.per_rank[0].remove(Action(Kind.BACKWARD_WEIGHT, 0, 2, 0))
    with pytest.raises(ScheduleError, match=r"rank 0: never runs BACKWARD_WEIGHT of stage 0, micro-batch 2"):
        validate(s)
    s = editable(gpipe(2, 2))
    s.per_rank[0].insert(1, Action(Kind.FORWARD, 0, 0, 0))
    with pytest.raises(ScheduleError, match=r"rank 0, action 1 F\(stage=0, mb=0\): repeats action 0 on rank 0"):
        validate(s)


def test_validator_catches_wrong_peer_missing_sync_and_late_optimizer_step():
    s = editable(one_f_one_b(3, 3))
    i = index_of(s.per_rank[0], Kind.SEND_ACT, 0, 1)
    s.per_rank[0][i] = dataclasses.replace(s.per_rank[0][i], peer=2)
    with pytest.raises(ScheduleError, match=r"rank 0, action \d+ SEND_ACT.*: this transfer goes from rank 0 to rank 1"):
        validate(s)
    s = editable(chimera(4, 4))
    s.per_rank[3] = [a for a in s.per_rank[3] if not (a.kind is Kind.GRAD_SYNC and a.stage == 3)]
    with pytest.raises(ScheduleError, match=r"rank 3: has 0 GRAD_SYNC of stage 3, needs exactly 1"):
        validate(s)
    s = editable(one_f_one_b(2, 2))
    s.per_rank[1].insert(0, s.per_rank[1].pop())
    with pytest.raises(ScheduleError, match=r"rank 1, action 0 OPT_STEP: the optimizer step must be the rank's last action"):
        validate(s)


# ---------------------------------------------------------------- NCCL's rendezvous semantics


def early_posting(schedule: Schedule, rank: int) -> list[P2PGroup]:
    """The executor as first committed: each receive a lone irecv posted two passes before its consumer, each send a
    lone isend right after its producer (unbatched, NCCL runs them on the two ranks' own communicator)."""
    actions = schedule.per_rank[rank]
    compute = [i for i, a in enumerate(actions) if a.kind in COMPUTE]
    groups = []
    for j, a in enumerate(actions):
        if a.kind in RECVS or a.kind in SENDS:
            k = bisect.bisect(compute, j)
            at = min(compute[k - 2] if k >= 2 else 0, j) if a.kind in RECVS else j
            groups.append(P2PGroup(at, (j,), stream=a.peer))
    return sorted(groups, key=lambda g: g.at)


def megatron_pairs(schedule: Schedule, rank: int) -> list[P2PGroup]:
    """Megatron's pairing: all transfers between two passes in one group (the sends of the pass before, the
    receives of the pass after), without looking at the other ranks."""
    actions = schedule.per_rank[rank]
    compute = [i for i, a in enumerate(actions) if a.kind in COMPUTE]
    slots: dict[int, list[int]] = {}
    for j, a in enumerate(actions):
        if a.kind in RECVS or a.kind in SENDS:
            slots.setdefault(bisect.bisect(compute, j), []).append(j)
    return [
        P2PGroup(compute[slot - 1] + 1 if slot else 0, tuple(sorted(js, key=lambda j: (actions[j].kind in RECVS, message_key(actions[j])))))
        for slot, js in sorted(slots.items())
    ]


def test_nccl_model_catches_the_early_posting_deadlock():
    """With buffered sends (gloo; the validator's timeline) early lone receives run; under NCCL's rendezvous each
    rank's stream is stuck at a receive whose sender is stuck behind its own receive. The executor's groups finish."""
    s = one_f_one_b(2, 4)
    run_timeline(s)
    with pytest.raises(
        ScheduleError,
        match=r"^schedule 1f1b deadlocks under NCCL's rendezvous p2p.*: rank 0 waits at action 4 "
        r"RECV_GRAD\(stage=1, mb=0, from rank 1\): its stream is stuck at RECV_GRAD\(stage=1, mb=0, from rank 1\), "
        r"which rank 1 has not issued yet; rank 1 waits at action 0 RECV_ACT\(stage=0, mb=0, from rank 0\): its "
        r"stream is stuck at RECV_ACT\(stage=0, mb=0, from rank 0\), whose match on rank 0 is queued behind "
        r"RECV_GRAD\(stage=1, mb=0, from rank 1\)",
    ):
        check_rendezvous(s, early_posting)
    check_rendezvous(s)
    for name in SCHEDULES:  # every schedule, the steady state included (m = 2p)
        s = build_schedule(name, 4, 8, 2 if name == "interleaved" else 1)
        with pytest.raises(ScheduleError, match="deadlocks under NCCL's rendezvous p2p"):
            check_rendezvous(s, early_posting)
        check_rendezvous(s)


def test_pairing_by_gaps_alone_deadlocks_interleaved():
    """Megatron's send-with-receive pairing suffices for 1F1B but not at interleaving's chunk boundaries, where both
    ranks of a pair send a gradient before receiving the other's: why the groups follow the schedule's timeline."""
    check_rendezvous(one_f_one_b(4, 8), megatron_pairs)
    with pytest.raises(
        ScheduleError,
        match=r"interleaved deadlocks .* rank 0 waits at action \d+ RECV_GRAD\(stage=3, mb=1, "
        r"from rank 1\): its stream is stuck at SEND_GRAD\(stage=2, mb=0, to rank 1\)",
    ):
        check_rendezvous(interleaved(2, 4, 2), megatron_pairs)
    check_rendezvous(interleaved(2, 4, 2))


def test_nccl_model_catches_out_of_order_matching_swapped_syncs_and_early_sends():
    """NCCL pairs the k-th send of a pair with the k-th receive, whatever the tag: issued out of order, the wrong
    tensor would arrive. Chimera's syncs are exchange groups on the same stream: swapped on one rank, NCCL would pair
    one stage's gradients with the other's."""

    def swapped_receives(schedule: Schedule, rank: int) -> list[P2PGroup]:
        groups = p2p_groups(schedule, rank)
        return [groups[1], groups[0], *groups[2:]] if rank == 1 else groups

    with pytest.raises(
        ScheduleError,
        match=r"gpipe mismatches under NCCL's in-order matching: rank 0's send #0 to rank 1 is "
        r"SEND_ACT\(stage=0, mb=0, to rank 1\) but rank 1's receive #0 from rank 0 is "
        r"RECV_ACT\(stage=0, mb=1, from rank 0\)",
    ):
        check_rendezvous(gpipe(2, 4), swapped_receives)
    s = editable(chimera(4, 4))
    s.per_rank[0][-3], s.per_rank[0][-2] = s.per_rank[0][-2], s.per_rank[0][-3]
    with pytest.raises(
        ScheduleError,
        match=r"rank 3's send #0 to rank 0 is send of GRAD_SYNC\(stage=0, with rank 0\) but rank 0's "
        r"receive #0 from rank 3 is receive of GRAD_SYNC\(stage=3, with rank 3\)",
    ):
        check_rendezvous(s, megatron_pairs)  # (the default groups need the buffered timeline, which already hangs)

    def send_too_early(schedule: Schedule, rank: int) -> list[P2PGroup]:
        groups = p2p_groups(schedule, rank)
        return [dataclasses.replace(groups[0], at=0), *groups[1:]] if rank == 0 else groups

    with pytest.raises(
        ScheduleError,
        match=r"rank 0's action 1 SEND_ACT\(stage=0, mb=0, to rank 1\), grouped before action 0, "
        r"is issued before the pass that produces it",
    ):
        check_rendezvous(one_f_one_b(2, 2), send_too_early)


def transfers(schedule: Schedule) -> int:
    """Sends in the schedule, counting each pairwise gradient exchange (Chimera's GRAD_SYNC) once per rank."""
    return sum(a.kind in SENDS or a.kind is Kind.GRAD_SYNC for actions in schedule.per_rank for a in actions)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_is_nccl_safe_at_any_lookahead(name):
    """The proof in p2p_groups does not depend on how far ahead receives may be hoisted: checked from 0 to 8 passes."""
    for p, m, v in [(2, 2, 2), (2, 6, 3), (3, 6, 2), (4, 4, 2), (4, 8, 2), (4, 12, 4), (6, 12, 2), (8, 16, 2)]:
        try:
            s = build_schedule(name, p, m, v if name == "interleaved" else 1)
        except ScheduleError:
            continue
        for lookahead in (0, 1, 2, 8):
            assert check_rendezvous(s, lambda s, rank: p2p_groups(s, rank, lookahead)) == transfers(s) > 0


def test_evaluation_order_is_nccl_safe():
    """forward_only: for each batch, every rank runs its stages (the first replicas) in stage order, a lone receive
    before and a lone send after each. Batched on the group's one stream, that (batch, stage) order cannot hang."""

    def lone(schedule: Schedule, rank: int) -> list[P2PGroup]:
        return [P2PGroup(j, (j,)) for j, a in enumerate(schedule.per_rank[rank]) if a.kind in SENDS or a.kind in RECVS]

    for name in SCHEDULES:
        s = build_schedule(name, 4, 8, 2 if name == "interleaved" else 1)
        owner = [ranks[0] for ranks in s.stage_ranks]
        per_rank: list[list[Action]] = [[] for _ in range(s.ranks)]
        for b in range(3):
            for stage, rank in enumerate(owner):
                if stage > 0 and owner[stage - 1] != rank:
                    per_rank[rank].append(Action(Kind.RECV_ACT, stage - 1, b, peer=owner[stage - 1]))
                per_rank[rank].append(Action(Kind.FORWARD, stage, b))
                if stage < len(owner) - 1 and owner[stage + 1] != rank:
                    per_rank[rank].append(Action(Kind.SEND_ACT, stage, b, peer=owner[stage + 1]))
        forward_only = dataclasses.replace(s, per_rank=[actions + [Action(Kind.OPT_STEP)] for actions in per_rank])
        assert check_rendezvous(forward_only, lone) == 3 * sum(x != y for x, y in zip(owner, owner[1:]))  # 3 batches x stage boundaries


# ---------------------------------------------------------------- the simulator reproduces the closed forms

UNIFORM = [Costs(1, 1, 1), Costs(1, 2, 0), Costs(2, 1, 1), Costs(0.7, 1.3, 0.4)]


@pytest.mark.parametrize("schedule_fn", [gpipe, one_f_one_b])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(schedule_fn, p):
    for m in range(1, 17):
        for costs in UNIFORM:
            result = simulate(schedule_fn(p, m), costs)
            per_mb = costs.forward + costs.backward + costs.weight
            assert close(result.step_time, (m + p - 1) * per_mb), (p, m, costs)
            assert close(result.bubble_fraction, (p - 1) / (m + p - 1)), (p, m, costs)
            assert close(closed_form_bubble(schedule_fn(p, m).name, p, m, 1, costs).bubble_fraction, result.bubble_fraction)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(p, v):
    for m in range(p, 17, p):
        for costs in UNIFORM:  # per chunk: a chunk is one model stage of p*v
            result = simulate(interleaved(p, m, v), costs)
            per_chunk = costs.forward + costs.backward + costs.weight
            assert close(result.step_time, (v * m + p - 1) * per_chunk), (p, v, m, costs)
            assert close(result.bubble_fraction, (p - 1) / (v * m + p - 1)), (p, v, m, costs)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zb_h1_bubble_is_a_third_of_1f1b(p):
    for m in range(p, 17):
        zb, base = simulate(zb_h1(p, m), Costs(1, 1, 1)), simulate(one_f_one_b(p, m), Costs(1, 1, 1))
        assert close(zb.bubble_fraction, (p - 1) / (3 * m + p - 1)), (p, m)
        assert close(zb.step_time - 3 * m, (base.step_time - 3 * m) / 3), "bubble time is 1F1B's over three"
        for tf, tb, tw in [(2, 1, 1), (1, 2, 1), (1, 1, 0.5), (1.5, 1, 1)]:  # the paper's (p-1)(tF+tB-tW), tW <= tF
            result = simulate(zb_h1(p, m), Costs(tf, tb, tw))
            assert close(result.step_time, m * (tf + tb + tw) + (p - 1) * (tf + tb - tw)), (p, m, tf, tb, tw)
            assert closed_form_bubble("zb-h1", p, m, 1, Costs(tf, tb, tw)).exact


def test_zb_h1_before_the_pipeline_fills():
    """m < p: this construction takes (2m + 2p - 1) slots with tF=tB=tW=1, above the m >= p formula."""
    for p in (2, 4, 8):
        for m in range(1, p):
            assert close(simulate(zb_h1(p, m), Costs(1, 1, 1)).step_time, 2 * m + 2 * p - 1), (p, m)
            assert not closed_form_bubble("zb-h1", p, m).exact


@pytest.mark.parametrize("d", [2, 4, 6, 8])
def test_chimera_bubble_is_d_minus_2_over_2n_plus_d_minus_2(d):
    for n in (d, 2 * d, 3 * d):
        for costs in (Costs(1, 1, 0), Costs(1, 0.5, 0.5), Costs(2, 1.5, 0.5)):  # forward = full backward
            result = simulate(chimera(d, n), costs)
            assert close(result.bubble_fraction, (d - 2) / (2 * n + d - 2)), (d, n, costs)
            assert closed_form_bubble("chimera", d, n, 1, costs).exact


def test_chimera_formula_needs_equal_forward_and_backward():
    """With backward = 2 x forward the paper's count does not hold (an exhaustive search at D=4 finds no better order)."""
    result = simulate(chimera(4, 4), Costs(1, 1, 1))
    assert close(result.bubble_fraction, 0.25) and not close(result.bubble_fraction, 0.2)
    assert not closed_form_bubble("chimera", 4, 4, 1, Costs(1, 1, 1)).exact


def test_chimera_beats_1f1b_and_pays_for_its_gradient_syncs():
    assert simulate(chimera(4, 8), Costs(1, 1, 0)).step_time < simulate(one_f_one_b(4, 8), Costs(1, 1, 0)).step_time
    base = simulate(chimera(4, 4), Costs(1, 1, 0)).step_time
    assert close(simulate(chimera(4, 4), Costs(1, 1, 0, grad_sync=0.5)).step_time, base + 2 * 0.5)  # two stages, in turn


def test_p2p_latency_and_per_stage_costs():
    p, m, x = 4, 6, 0.25
    gp = simulate(gpipe(p, m), Costs(1, 1, 1, p2p=x))
    assert close(gp.step_time, (m + p - 1) * 3 + 2 * (p - 1) * x), "each direction crosses p-1 links once on the critical path"
    assert not closed_form_bubble("gpipe", p, m, 1, Costs(1, 1, 1, p2p=x)).exact
    assert simulate(one_f_one_b(p, m), Costs(1, 1, 1, p2p=x)).bubble_fraction > (p - 1) / (m + p - 1)
    f, b = [1, 3, 2, 1], [2, 1, 4, 1]  # flow shop: sum of stages + (m-1) x the slowest, in each direction
    hetero = simulate(gpipe(4, 5), Costs(f, b, 0))
    assert close(hetero.step_time, sum(f) + sum(b) + 4 * (max(f) + max(b)))
    assert close(sum(hetero.busy), 5 * (sum(f) + sum(b)))
    with pytest.raises(ScheduleError, match=r"costs.forward has 3 per-stage values for 4 stages"):
        simulate(gpipe(4, 5), Costs([1, 2, 3], 1, 1))


# ---------------------------------------------------------------- stashed activations


def test_stash_counts():
    for p in (2, 4, 8):
        for m in (1, p - 1, p, 2 * p):
            if m < 1:
                continue
            assert simulate(one_f_one_b(p, m)).peak_stash == tuple(min(p - r, m) for r in range(p))
            assert simulate(gpipe(p, m)).peak_stash == (m,) * p
            # ZB-H1's input passes free each graph where 1F1B's backward does (the weight pass keeps only the deferred
            # linear inputs and output gradients, parallel/deferred.py); stage 0, whose W is its whole backward, holds p
            assert simulate(zb_h1(p, m)).peak_stash == tuple(min(p - r, m) for r in range(p))
    assert simulate(one_f_one_b(4, 8)).peak_stash[0] == 4 and simulate(one_f_one_b(4, 8)).peak_stash[-1] == 1
    for d in (4, 6, 8):  # Chimera: between D/2+1 (end ranks) and D (middle ranks)
        assert simulate(chimera(d, 2 * d)).peak_stash == tuple(d // 2 + 1 + min(r, d - 1 - r) for r in range(d))
    p, v = 4, 2  # interleaved: Megatron's warm-up plus one, in chunk activations
    assert simulate(interleaved(p, 8, v)).peak_stash == tuple((p - r - 1) * 2 + (v - 1) * p + 1 for r in range(p))


# ---------------------------------------------------------------- the grid printer


def test_grid_of_a_tiny_1f1b():
    assert format_grid(one_f_one_b(2, 3)) == "\n".join(
        [
            "1f1b: p=2 m=3 v=1",
            "slot   |  0  1  2  3  4  5  6  7",
            "rank 0 | F0 F1  . B0 F2 B1  . B2",
            "rank 1 |  . F0 B0 F1 B1 F2 B2  .",
        ]
    )


def test_grid_marks_chunks_and_weight_passes():
    grid = format_grid(interleaved(2, 2, 2)).splitlines()
    assert grid[2].split("|")[1].split()[:4] == ["0F0", "0F1", "2F0", "2F1"]
    assert format_grid(zb_h1(2, 2)).splitlines()[2:] == [  # W fills rank 0's cool-down; the last rank defers both
        "rank 0 | F0 F1  . B0 W0 B1 W1",
        "rank 1 |  . F0 B0 F1 B1 W0 W1",
    ]


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "request_, message",
    [
        (("interleaved", 4, 6, 2), r"^microbatches=6: interleaved 1F1B needs micro-batches divisible by stages=4 .*; use --microbatches 8$"),
        (("interleaved", 4, 8, 1), r"^chunks=1: interleaved 1F1B needs at least 2 model chunks per rank; use --chunks 2"),
        (("chimera", 3, 6, 1), r"^stages=3: Chimera needs an even number of stages .*; use --stages 4 or 2$"),
        (("chimera", 4, 6, 1), r"^microbatches=6: Chimera runs whole basic units of D=4 micro-batches .*; use --microbatches 4 or 8$"),
        (("1f1b", 4, 0, 1), r"^microbatches=0: a step needs at least one micro-batch; use --microbatches 4 or more"),
        (("gpipe", 0, 4, 1), r"^stages=0: a pipeline needs at least one stage; use --stages 1 or more$"),
        (("1f1b", 4, 8, 2), r"^chunks=2: only the interleaved schedule holds several model chunks per rank"),
        (("pipedream", 4, 8, 1), r"^schedule='pipedream' is not one of gpipe, 1f1b, interleaved, zb-h1, chimera"),
    ],
)
def test_impossible_requests_are_refused_in_one_line(request_, message):
    with pytest.raises(BehemothError, match=message) as err:
        build_schedule(*request_)
    assert "\n" not in str(err.value)


def test_schedule_functions_refuse_too():
    with pytest.raises(ScheduleError, match="stages=5: Chimera needs an even number"):
        chimera(5, 10)


# ---------------------------------------------------------------- the report


def test_report_prints_table_grid_and_writes_gantt(tmp_path, capsys):
    png = tmp_path / "charts" / "zb.png"
    assert schedule_main(["--stages", "4", "--microbatches", "8", "--chunks", "2", "--grid", "zb-h1", "--gantt", str(png)]) == 0
    out = capsys.readouterr().out
    for name, bubble in [("gpipe", 3 / 11), ("1f1b", 3 / 11), ("interleaved", 3 / 19), ("zb-h1", 3 / 27), ("chimera", 0.2)]:
        assert any(line.startswith(name) and f"{bubble:.4f}" in line for line in out.splitlines()), (name, out)
    assert "rank 3 |  .  .  . F0 B0 F1 B1" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_report_compares_on_the_same_model_and_skips_what_cannot_run(tmp_path, capsys):
    rows = {r.name: r for r in compare(3, 5, 2, Costs(1, 1, 1))}
    assert "Chimera needs an even number" in rows["chimera"].skipped and rows["interleaved"].skipped
    rows = {r.name: r for r in compare(4, 8, 2, Costs(1, 1, 1))}
    assert rows["interleaved"].result.step_time < rows["1f1b"].result.step_time, "chunks cost 1/v of a rank's share"
    assert sum(rows["interleaved"].result.busy) == pytest.approx(sum(rows["1f1b"].result.busy))
    assert schedule_main(["--stages", "4", "--microbatches", "8", "--gantt", str(tmp_path / "all.png")]) == 0
    assert (tmp_path / "all.png").stat().st_size > 10_000
    capsys.readouterr()
    assert schedule_main(["--stages", "3", "--microbatches", "4", "--grid", "chimera"]) == 2
    assert "behemoth: error: --grid chimera cannot run this configuration: stages=3" in capsys.readouterr().err
    assert schedule_main(["--stages", "4", "--microbatches", "8", "--p2p-ms", "-1"]) == 2
