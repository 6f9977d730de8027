"""Streamed offload under a pipeline in the planner (each stage streams its own units, offload/stage_stream.py): searched
when nothing fits the devices, its recomputation and I/O priced, the split-backward schedules' gradients kept between
BI and W counted, and the search's choice the brute-force optimum of its own cost model."""

from __future__ import annotations

import pytest

from behemoth.cli.plan import assumptions
from behemoth.config import load_config
from behemoth.planner.cost import price
from behemoth.planner.footprint import rank_memory
from behemoth.planner.layout import Layout, Offload, Workload
from behemoth.planner.search import Space, enumerate_layouts, refusals, search
from tests.test_planner_search_dims import DENSE, SCHEDULES, optimum, small_cluster

HOST = Offload(params="host", grads="host", optimizer="host")


@pytest.mark.parametrize("memory_gb", [0.0002, 0.00025])
def test_a_streamed_pipeline_is_searched_when_nothing_fits_and_is_the_brute_force_optimum(memory_gb):
    """4 devices of 200 (250) KB: no plan fits on the devices; with offload the best is a 2-stage pipeline streaming its
    units from host memory, `problems()` accepts it, and the search finds the brute-force best."""
    cfg = load_config(None, DENSE)
    cluster, space = small_cluster(memory_gb), Space(**SCHEDULES)
    work = Workload.of(cfg)
    assert not [c for c in search(work, cluster, 4, Space(offload=(Offload(),), **SCHEDULES), cfg=cfg, exact=0).ranked]
    best, _ = optimum(cfg, 4, cluster, space)
    found = search(work, cluster, 4, space, cfg=cfg, exact=0).ranked[0]
    assert found.step_seconds == pytest.approx(best.step_seconds, rel=1e-9), (found.layout.describe(), best.layout.describe())
    assert found.layout.pp == 2 and found.layout.offload.streams and refusals(cfg, found.layout, 4) == []
    assert "streamed pipeline stages: each block recomputed" in assumptions([found], work, cluster)


def test_streamed_pipelines_are_enumerated_only_where_the_stage_streamer_runs():
    """Stage 0 (the streamer's units are ZeRO-3's), no Chimera (two replicas of each stage), not with a tied head."""
    cfg = load_config(None, DENSE)
    space = Space(schedules=("1f1b", "zb-h1", "chimera"))
    on_device = enumerate_layouts(Workload.of(cfg), 4, space, small_cluster(1.0))
    assert "chimera" in {lay.schedule for lay in on_device}
    piped = [lay for lay in enumerate_layouts(Workload.of(cfg), 4, space, small_cluster(1.0), (HOST,)) if lay.pp > 1]
    assert piped and {lay.zero for lay in piped} == {0} and {lay.schedule for lay in piped} == {"1f1b", "zb-h1"}
    tied = load_config(None, [*DENSE, "model.tie_embeddings=true"])
    assert not [lay for lay in enumerate_layouts(Workload.of(tied), 4, Space(**SCHEDULES), small_cluster(1.0), (HOST,)) if lay.pp > 1]


def test_a_streamed_split_backward_keeps_two_hidden_states_per_block_until_its_weight_pass():
    """zb-h1 streamed: the last rank's BI keeps each block's input and output gradient for min(rank, m - 1) pending W
    passes (1F1B none), its stash is a recomputing stage's, and its W recomputes the blocks again (and reads the
    units once more)."""
    cfg = load_config(None, [*DENSE, "train.global_batch=8"])
    work = Workload.of(cfg)
    base = Layout(dp=1, tp=1, pp=2, zero=0, micro_batch=2, microbatches=4, offload=HOST)
    bounds = (0, 1, 2)
    split, plain = base.but(schedule="zb-h1"), base.but(schedule="1f1b")
    hidden = 2 * work.seq_len * work.census.shape.d_model * work.act_bytes
    assert rank_memory(work, split, bounds, 1).deferred == pytest.approx(1 * 1 * 2 * hidden)  # 1 pending W, 1 block
    assert rank_memory(work, plain, bounds, 1).deferred == 0.0
    resident = base.but(schedule="zb-h1", offload=Offload(), recompute=(0, 1))
    assert rank_memory(work, split, bounds, 0).stash == rank_memory(work, resident, bounds, 0).stash
    cluster = small_cluster(1.0)
    t_split, t_plain = price(work, split, cluster).time, price(work, plain, cluster).time
    assert t_split.recompute > t_plain.recompute > 0 and t_split.offload_io > t_plain.offload_io


def counted_collectives(cfg_dict: dict) -> dict:
    """One rank of a streamed pipeline: the bytes a step all-gathers and reduce-scatters (the engine's meter)."""
    from behemoth.config import Config
    from behemoth.engine import build_engine
    from behemoth.profiler.measure import random_micro_batches
    from behemoth.topology import init_runtime

    cfg = Config.model_validate(cfg_dict)
    rt = init_runtime(timeout_s=cfg.run.timeout_s, **cfg.parallel.degrees())
    try:
        engine = build_engine(cfg, rt)
        batches = random_micro_batches(cfg, rt.dims, seed=rt.coordinate("dp"))
        engine.model.meter.reset()
        engine.train_step(batches, lr=1e-4)
        ops = engine.model.meter.summary()
        return {"pp": rt.coordinate("pp"), **{op: ops.get(op, {}).get("bytes", 0) for op in ("all_gather", "reduce_scatter", "all_reduce")}}
    finally:
        engine.close()
        rt.close()


HOST_STATES = tuple(f"offload.{k}=host" for k in ("params", "grads", "optimizer"))
STREAMED_DP = ("model.n_layer=4", "parallel.pp=2", "train.micro_batch=1", "train.global_batch=8", *HOST_STATES)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b"])
def test_a_streamed_pipelines_data_parallel_traffic_is_what_its_units_move(schedule, tmp_path):
    """pp=2 x dp=2 streamed from host memory (4 gloo ranks): each rank's all-gathered and reduce-scattered bytes in a
    step, counted by the engine's meter, equal the planner's count of its units' stays (each gathers the unit, each that
    computes gradients reduce-scatters them; 1F1B's first stage keeps its embedding from a backward into the next
    forward) to the padding of its units (they were equal to the byte), and no all-reduce of the gradients runs."""
    from behemoth.config import Config
    from behemoth.planner.cost import resolve_bounds
    from behemoth.planner.stream_traffic import streamed_traffic_bytes
    from tests.common import tiny_config
    from tests.dist import run_ranks

    raw = tiny_config(tmp_path / "run", *STREAMED_DP, f"parallel.schedule={schedule}")
    ranks = run_ranks(4, counted_collectives, raw, timeout=300)
    cfg = Config.model_validate(raw)
    work, lay = Workload.of(cfg), Layout.of_config(cfg, 4)
    bounds = resolve_bounds(work, lay)
    for got in ranks:
        gathered, scattered = streamed_traffic_bytes(work, lay, bounds, got["pp"])
        assert abs(got["all_gather"] / gathered - 1) < 0.002 and abs(got["reduce_scatter"] / scattered - 1) < 0.002, (got, gathered, scattered)
        assert got["all_reduce"] < 64  # the loss's scalars, no gradients


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "dualpipev"])
def test_the_closed_count_of_streamed_stays_bounds_the_listed_one(schedule):
    """A long pipeline's stays are counted without merges: the same reduce-scatters as the visit order's stays, at
    least as many gathers, more where a pass's first unit is kept from the pass before (the embedding from a backward
    into a forward, the last block from a forward into its backward, a W's first block from its BI); GPipe (all
    forwards, then all backwards) merges at most once a stage, at its turn."""
    from behemoth.planner.stream_traffic import closed_stays, unit_stays

    v = 2 if schedule in ("interleaved", "zbv", "dualpipev") else 1
    lay = Layout(pp=2, micro_batch=1, microbatches=4, schedule=schedule, chunks=v, offload=HOST)
    bounds = tuple(range(0, 4 * lay.stages + 1, 4))
    for rank in range(2):
        listed, closed = unit_stays(schedule, 2, 4, v, rank, bounds), closed_stays(lay, bounds, rank)
        assert [u for u, _, _ in listed] == sorted(u for u, _, _ in closed)
        assert sum(g for *_, g in listed) == sum(g for *_, g in closed)
        extra = sum(s for _, s, _ in closed) - sum(s for _, s, _ in listed)
        assert 0 <= extra <= (len(lay.held_stages(rank)) if schedule == "gpipe" else extra), (schedule, rank, listed, closed)
