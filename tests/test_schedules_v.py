"""ZBV, DualPipeV and 1F1B with Merak's shifted critical path as data: the same orders as torch.distributed.pipelining's
own generators, simulated against their closed forms (bubble and stash), refused where they
cannot run, and compared by `behemoth schedule`. (Validation and the NCCL model run every registered schedule in
tests/test_pipeline_schedules.py.)"""

from __future__ import annotations

import dataclasses
import math
import types

import pytest

from behemoth.errors import BehemothError
from behemoth.parallel.pipeline import Action, Costs, Kind, ScheduleError, build_schedule, closed_form_bubble, simulate, validate
from behemoth.parallel.pipeline.analysis.gantt import format_grid
from behemoth.parallel.pipeline.analysis.report import compare, schedule_main
from behemoth.parallel.pipeline.schedules import COMPUTE, dualpipev, one_f_one_b, one_f_one_b_scp, zbv

TORCH_KIND = {"F": Kind.FORWARD, "I": Kind.BACKWARD_INPUT, "W": Kind.BACKWARD_WEIGHT, "B": Kind.BACKWARD}


def torch_order(cls: type, p: int, m: int, rank: int) -> list[tuple[Kind, int, int]]:
    """torch.distributed.pipelining's own compute order for `rank` (its pure generator, no process group); an overlapped
    forward-and-backward pair as its forward, then its backward."""
    ns = types.SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    out = []
    for a in cls._calculate_single_rank_operations(ns, rank):
        for sub in (a.sub_actions or (a,)) if a is not None else ():
            kind = sub.computation_type.value  # F, I, W, or B: a full backward
            out.append((TORCH_KIND[kind], sub.stage_index, sub.microbatch_index))
    return out


def ours(schedule, rank: int) -> list[tuple[Kind, int, int]]:
    return [(a.kind, a.stage, a.microbatch) for a in schedule.per_rank[rank] if a.kind in COMPUTE]


@pytest.mark.parametrize("p,m", [(1, 2), (2, 7), (4, 13)])
def test_zbv_and_dualpipev_run_torchs_own_orders(p, m):
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV, ScheduleZBVZeroBubble

    for rank in range(p):
        assert ours(zbv(p, m), rank) == torch_order(ScheduleZBVZeroBubble, p, m, rank), ("zbv", rank)
        assert ours(dualpipev(p, m), rank) == torch_order(ScheduleDualPipeV, p, m, rank), ("dualpipev", rank)


def test_v_placement_and_local_handover():
    s = zbv(4, 8)
    assert s.chunk_stages == ((0, 7), (1, 6), (2, 5), (3, 4)) and s.num_stages == 8 and s.split_backward
    assert [s.rank_of(st, 0) for st in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    last = s.per_rank[3]  # stages 3 and 4 meet on rank 3: no p2p between them
    assert not [a for a in last if a.kind in (Kind.SEND_ACT, Kind.RECV_ACT) and a.stage == 3]
    assert {a.peer for a in s.per_rank[0] if a.peer is not None} == {1}, "rank 0 talks to rank 1 only, down and back up"


# ---------------------------------------------------------------- closed forms


@pytest.mark.parametrize("name", ["zbv", "dualpipev"])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_v_bubble_is_p_minus_1_over_6m_plus_p_minus_1(name, p):
    """Equal F, B and W per chunk: the only idle time is the first forward's way down to the last rank."""
    checked = 0
    for t in (1.0, 0.25):
        for m in range(2 * p - 1 if name == "zbv" else 2 * p, 3 * p + 2, 1 if p < 8 else 3):
            r = simulate(build_schedule(name, p, m, 2), Costs(t, t, t))
            cf = closed_form_bubble(name, p, m, 2, Costs(t, t, t))
            assert cf.exact and math.isclose(r.bubble_fraction, cf.bubble_fraction, abs_tol=1e-12), (p, m, r.bubble_fraction)
            assert math.isclose(r.step_time, (6 * m + p - 1) * t)
            checked += 1
    assert checked >= 4
    assert not closed_form_bubble(name, p, 4 * p, 2, Costs(1, 2, 1)).exact


def test_v_bubble_halves_zb_h1_on_the_same_model():
    """`behemoth schedule` compares all on the same model: a chunk costs half a rank's share, so ZBV idles (p-1)/2 of a
    rank's F+B+W slot where ZB-H1 idles p-1 of them and 1F1B 3(p-1)."""
    rows = {r.name: r.result for r in compare(4, 8, 2, Costs(1, 1, 1)) if r.result is not None}
    idle = {name: res.step_time - sum(res.busy) / 4 for name, res in rows.items()}
    assert idle["1f1b"] == pytest.approx(9.0) and idle["zb-h1"] == pytest.approx(3.0)
    assert idle["zbv"] == pytest.approx(1.5) and idle["dualpipev"] == pytest.approx(1.5)


def test_v_stash():
    """ZBV: every rank holds 2p chunk activations (p full stages: 1F1B's rank-0 peak on every rank) once m >= 2p-1,
    rank 0 min(m+1, 2p) before; DualPipeV one more, 2p+1."""
    for p in (1, 2, 3, 4, 6):
        for m in range(1, 3 * p + 1):
            s = simulate(zbv(p, m))
            assert s.peak_stash[0] == min(m + 1, 2 * p) and max(s.peak_stash) == min(2 * m, 2 * p), (p, m, s.peak_stash)
            if m >= 2 * p - 1:
                assert s.peak_stash == (2 * p,) * p
            if m >= 2 * p:
                assert simulate(dualpipev(p, m)).peak_stash == (2 * p + 1,) * p


SCP_COSTS = [Costs(1, 1, 1), Costs(0.7, 1.3, 0.4), Costs(1, 3, 0), Costs(0.2, 1, 1), Costs(1, 0.5, 0.5)]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
def test_scp_step_takes_the_recomputation_off_the_backward_chain(p):
    """Step m(2f+B) + (p-1)(f+B) - 3f against 1F1B-with-recompute's (m+p-1)(2f+B) (B = tB + tW, R = f <= B)."""
    for c in SCP_COSTS:
        f, b = c.forward, c.backward + c.weight
        for m in range(max(p, 3), 2 * p + 3):
            r = simulate(one_f_one_b_scp(p, m), c)
            cf = closed_form_bubble("1f1b-scp", p, m, 1, c)
            assert cf.exact and math.isclose(r.bubble_fraction, cf.bubble_fraction, abs_tol=1e-12), (c, p, m)
            want = m * (f + b) if p == 1 else m * (2 * f + b) + (p - 1) * (f + b) - 3 * f
            assert math.isclose(r.step_time, want), (c, p, m)
            inside = simulate(one_f_one_b(p, m), Costs(f, c.backward + f, c.weight)).step_time  # checkpointing: R inside B
            assert math.isclose(inside, (m + p - 1) * (2 * f + b)) and (p == 1 or r.step_time < inside)
    assert not closed_form_bubble("1f1b-scp", p, 8, 1, Costs(3, 1, 1)).exact, "a forward longer than the backward breaks it"


def test_scp_recomputes_all_but_the_last_micro_batch_and_stashes_two():
    for p in (2, 3, 4, 6):
        for m in range(1, 3 * p):
            s = one_f_one_b_scp(p, m)
            again = [[a.microbatch for a in actions if a.kind is Kind.RECOMPUTE] for actions in s.per_rank]
            assert again == [list(range(m - 1))] * (p - 1) + [[]], "the last stage never recomputes"
            assert simulate(s).peak_stash == (min(2, m),) * (p - 1) + (1,)
            assert simulate(one_f_one_b(p, m)).peak_stash == tuple(min(p - r, m) for r in range(p))


def test_scp_keeping_more_cool_down_activations_buys_no_time_and_keeping_none_costs_one_recompute():
    for c in SCP_COSTS[:3]:
        for p, m in [(2, 4), (4, 8), (4, 13), (6, 12)]:
            default = simulate(one_f_one_b_scp(p, m), c)
            every = simulate(one_f_one_b_scp(p, m, keep=p), c)
            none = simulate(one_f_one_b_scp(p, m, keep=0), c)
            assert every.step_time == pytest.approx(default.step_time) and every.peak_stash[0] == min(p, m)
            assert none.step_time == pytest.approx(default.step_time + c.forward) and none.peak_stash[0] == 1


def test_scp_recomputation_issued_before_the_gradient_arrives():
    actions = one_f_one_b_scp(3, 6).per_rank[1]
    for i, a in enumerate(actions):
        if a.kind is Kind.RECOMPUTE:
            assert actions[i + 1] == Action(Kind.RECV_GRAD, 2, a.microbatch, 0, 2) and actions[i + 2].kind is Kind.BACKWARD
    assert format_grid(one_f_one_b_scp(2, 3)).splitlines()[2:] == [  # R0 runs while rank 1 computes B0's gradient
        "rank 0 | F0 F1 R0 B0 F2 R1 B1 B2",
        "rank 1 |  . F0 B0 F1 B1 F2 B2  .",
    ]


# ---------------------------------------------------------------- the validator and refusals


def test_validator_catches_a_backward_before_its_recomputation_and_a_mixed_backward():
    s = one_f_one_b_scp(2, 3)
    broken = dataclasses.replace(s, per_rank=[list(a) for a in s.per_rank])
    rank0 = broken.per_rank[0]
    r = next(i for i, a in enumerate(rank0) if a.kind is Kind.RECOMPUTE)
    b = next(i for i, a in enumerate(rank0) if a.kind is Kind.BACKWARD and a.microbatch == rank0[r].microbatch)
    rank0.insert(b, rank0.pop(r))  # R after its backward
    with pytest.raises(ScheduleError, match="comes before the recomputation of its activations"):
        validate(broken)
    v = zbv(2, 4)
    twice = dataclasses.replace(v, per_rank=[list(a) for a in v.per_rank])
    twice.per_rank[0].insert(-1, Action(Kind.BACKWARD, 0, 0, 0))
    with pytest.raises(ScheduleError, match="runs both a full and a split backward of stage 0, micro-batch 0"):
        validate(twice)


@pytest.mark.parametrize(
    "request_, message",
    [
        (("dualpipev", 4, 7, 2), r"^microbatches=7: DualPipeV needs at least 2 x stages=4 micro-batches .*; use --microbatches 8 or more$"),
        (("zbv", 4, 8, 3), r"^chunks=3: zbv holds exactly 2 model chunks per rank, placed in a V; use --chunks 2"),
        (("1f1b-scp", 4, 8, 2), r"^chunks=2: only the interleaved schedule holds several model chunks per rank"),
    ],
)
def test_impossible_requests_are_refused_in_one_line(request_, message):
    with pytest.raises(BehemothError, match=message) as err:
        build_schedule(*request_)
    assert "\n" not in str(err.value)
    with pytest.raises(ScheduleError, match="keep=-1"):
        one_f_one_b_scp(2, 4, keep=-1)


def test_report_lists_the_new_schedules(capsys):
    assert schedule_main(["--stages", "4", "--microbatches", "8", "--grid", "zbv"]) == 0
    out = capsys.readouterr().out
    for name, bubble in [("zbv", 3 / 51), ("dualpipev", 3 / 51)]:
        assert any(line.startswith(name) and f"{bubble:.4f}" in line for line in out.splitlines()), (name, out)
    assert any(line.startswith("1f1b-scp") for line in out.splitlines())
    assert "rank 3 |   .   .   . 3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4B0 4W0" in out  # stages 3 and 4 meet on rank 3
