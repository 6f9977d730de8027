"""A pipeline stage's unit visits follow its schedule's own passes (offload/stage_order.py), and the schedules a streamed
stage cannot follow are named with their reason."""

import pytest

from behemoth.offload.order import harmony_order, plan_residencies
from behemoth.offload.stage_order import pipeline_refusal, stage_order, stage_passes, stage_units
from behemoth.parallel.pipeline.actions import Kind
from behemoth.parallel.pipeline.schedules import build_schedule

UNITS = [(0, 1, 2), (3, 4, 5)]  # embedding + 2 blocks | 2 blocks + head


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_each_pass_visits_its_stage_units_in_the_schedules_order(name):
    sch = build_schedule(name, 2, 4)
    for rank, units in enumerate(UNITS):
        visits = stage_order(sch, rank, UNITS)
        passes = [a for a in sch.per_rank[rank] if a.kind in (Kind.FORWARD, Kind.BACKWARD)]
        expected = []
        for a in passes:
            if a.kind is Kind.FORWARD:
                expected += [("FB" if u == 5 else "F", u, a.microbatch) for u in units]
            else:
                expected += [("B", u, a.microbatch) for u in reversed(units) if u != 5]
        assert [(v.kind, v.unit, v.mb) for v in visits] == expected
        assert {v.unit for v in visits} == set(units)


def test_gpipe_stage_fetches_each_unit_per_micro_batch_and_gradients_complete_once():
    """GPipe stage 0, 4 micro-batches, 3 units: 12 forward stays, 12 backward ones less the one that the last forward
    and the first backward share (unit 2); every unit's gradient completes in exactly one stay."""
    plan = plan_residencies(stage_order(build_schedule("gpipe", 2, 4), 0, UNITS), {})
    assert len(plan.stays) == 23
    assert sorted(s.unit for s in plan.stays if s.completes) == [0, 1, 2]
    whole = plan_residencies([a for a in harmony_order(4, 4) if a.unit in UNITS[0]], {})
    assert len(whole.stays) == 5  # Harmony: F0, F1, F2 + B2 (one stay), B1, B0


@pytest.mark.parametrize(
    "name,chunks,words",
    [
        ("gpipe", 1, ""),
        ("1f1b", 1, ""),
        ("interleaved", 2, ""),
        ("zb-h1", 1, ""),
        ("zbv", 1, ""),
        ("dualpipev", 1, ""),
        ("1f1b-scp", 1, ""),
        ("chimera", 1, "two replicas of every stage"),
    ],
)
def test_schedules_a_streamed_stage_cannot_follow_are_named(name, chunks, words):
    sch = build_schedule(name, 2, 4, chunks)
    why = pipeline_refusal(sch)
    assert (words in why and name in why) if words else why == ""
    if words:
        with pytest.raises(ValueError, match=words):
            stage_order(sch, 0, UNITS)


@pytest.mark.parametrize("name", ["zb-h1", "zbv", "dualpipev"])
def test_a_split_backward_visits_each_block_for_its_input_then_its_weight_gradient(name):
    """Every block of a later stage gets, per micro-batch, a BI visit (reverse order) and then a W visit (forward order),
    in its schedule's pass order; the first stage's input pass is empty and its weight pass the full backward (B, down to
    the embedding); every unit's gradient completes once, in the stay of its last gradient-making visit (the last W)."""
    sch = build_schedule(name, 2, 4)
    units = stage_units([0, 1, 2, 3, 4]) if sch.chunks == 2 else UNITS
    head = max(units[-1])
    for rank in range(2):
        visits = stage_order(sch, rank, units)
        for stage in sch.chunk_stages[rank]:
            blocks = [u for u in units[stage] if u not in (0, head)]
            for mb in range(4):
                mine = [(v.kind, v.unit) for v in visits if v.mb == mb and v.unit in units[stage] and v.kind != "F"]
                split = any(a.kind is Kind.BACKWARD_INPUT and (a.stage, a.microbatch) == (stage, mb) for a in sch.per_rank[rank])
                fb = [("FB", head)] if head in units[stage] else []  # the last stage's head, in its forward pass
                if 0 in units[stage] or not split:  # the first stage's W, or DualPipeV's full backward
                    assert mine == fb + [("B", u) for u in reversed(units[stage]) if u != head], (name, stage, mb, mine)
                else:
                    assert mine == fb + [("BI", u) for u in reversed(blocks)] + [("W", u) for u in blocks], (name, stage, mb, mine)
        plan = plan_residencies(visits, {})
        done = [s.unit for s in plan.stays if s.completes]
        assert sorted(done) == sorted(u for s in sch.chunk_stages[rank] for u in units[s]), (name, rank, done)
        for stay in plan.stays:
            kinds = {visits[i].kind for i in range(stay.first, stay.last + 1) if visits[i].unit == stay.unit}
            assert stay.grads == bool(kinds & {"B", "FB", "W"}), (name, rank, stay, kinds)  # a BI-only stay makes none
            if stay.completes:
                last = max(i for i, v in enumerate(visits) if v.unit == stay.unit)
                assert stay.last == last, (name, rank, stay)  # nothing visits a unit after its gradient completed


def test_1f1b_scp_streams_as_1f1b_its_recompute_passes_empty():
    """A streamed stage recomputes every block in its backward: 1f1b-scp's RECOMPUTE passes have no visits, and what is
    left is 1F1B's forwards and backwards in 1f1b-scp's own order."""
    sch = build_schedule("1f1b-scp", 2, 4)
    for rank in range(2):
        passes = stage_passes(sch, rank, UNITS)
        kinds = [sch.per_rank[rank][i].kind for i, _ in passes]
        assert Kind.RECOMPUTE not in kinds and kinds == [a.kind for a in sch.per_rank[rank] if a.kind in (Kind.FORWARD, Kind.BACKWARD)]
        assert any(a.kind is Kind.RECOMPUTE for a in sch.per_rank[0])


def test_stage_units_number_each_stages_embedding_blocks_and_head():
    assert stage_units([0, 2, 4]) == [(0, 1, 2), (3, 4, 5)]
    assert stage_units([0, 1, 2, 3, 4]) == [(0, 1), (2,), (3,), (4, 5)]  # interleaved: 4 stages of one block


@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_stage_passes_are_the_schedules_compute_passes_by_index(name, chunks):
    """Each pass is named by its index in the rank's action list (where the stage streamer runs it, between the
    schedule's transfers), and the passes' visits joined are `stage_order`."""
    sch = build_schedule(name, 2, 4, chunks)
    units = stage_units([0, 1, 2, 3, 4] if chunks == 2 else [0, 2, 4])
    for rank in range(2):
        passes = stage_passes(sch, rank, units)
        assert [i for i, _ in passes] == [i for i, a in enumerate(sch.per_rank[rank]) if a.kind in (Kind.FORWARD, Kind.BACKWARD)]
        assert all(v.mb == sch.per_rank[rank][i].microbatch for i, visits in passes for v in visits)
        assert [v for _, visits in passes for v in visits] == stage_order(sch, rank, units)
