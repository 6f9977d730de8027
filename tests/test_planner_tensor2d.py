"""2-D tensor parallelism (parallel.tp_mode=2d) in the planner: a layout round-trips through the plan a user writes, the
memory it predicts (1/q^2 of every parameter and activation, SUMMA's backward buffers) against the engine's measured
peak on a 2 x 2 grid, the enumeration proposing only grids the runtime accepts, and the search against brute force."""

from __future__ import annotations

import pytest

from behemoth.config import load_config
from behemoth.planner.layout import Layout, Workload
from behemoth.planner.search import Space, enumerate_layouts, refusals, search
from tests.test_planner_memory import mismatches
from tests.test_planner_search_dims import DENSE, MOE, SCHEDULES, optimum, small_cluster

GRID_PLANS = {  # measured within 0.5% (d_model=256 was not used to fit SUMMA's buffers)
    4: [
        ("parallel.tp=4", "parallel.tp_mode=2d", "train.micro_batch=2"),
        ("parallel.tp=4", "parallel.tp_mode=2d", "train.micro_batch=4", "parallel.zero_stage=1"),
        ("parallel.tp=4", "parallel.tp_mode=2d", "train.micro_batch=2", "model.d_model=256", "parallel.zero_stage=2"),
    ],
    8: [  # dp=2 x a 2 x 2 grid under ZeRO-3; cp=2 x a 2 x 2 grid (ring, with ZeRO-3, Ulysses over 4 heads per column)
        ("parallel.tp=4", "parallel.tp_mode=2d", "train.micro_batch=4", "parallel.zero_stage=3"),
        ("parallel.tp=4", "parallel.tp_mode=2d", "parallel.cp=2", "parallel.cp_mode=ring", "train.micro_batch=4"),
        ("parallel.tp=4", "parallel.tp_mode=2d", "parallel.cp=2", "parallel.cp_mode=ring", "train.micro_batch=2", "parallel.zero_stage=3"),
        ("parallel.tp=4", "parallel.tp_mode=2d", "parallel.cp=2", "parallel.cp_mode=ulysses", "train.micro_batch=4", "model.n_head=8"),
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(GRID_PLANS))
def test_predicted_memory_of_2d_plans_matches_measured(world, tmp_path):
    assert mismatches(world, GRID_PLANS[world], tmp_path) == []


def test_a_2d_layout_round_trips_through_the_plan_a_user_writes():
    cfg = load_config(None, [*DENSE, "parallel.tp=4", "parallel.tp_mode=2d", "train.micro_batch=2"])
    lay = Layout.of_config(cfg, 4)
    assert (lay.tp, lay.tp_mode, lay.grid, lay.seq_split) == (4, "2d", 2, True) and "2d[2x2]" in lay.describe()
    plan = lay.to_plan(cfg.parallel)
    assert (plan.tp, plan.tp_mode) == (4, "2d")
    assert Layout.of_config(load_config(None, DENSE), 1).tp_mode == "1d"


def test_2d_parameters_are_a_quarter_on_a_2x2_grid():
    """Model states of a 2 x 2 grid: exactly 1/4 of one process's, below 1-D tp=4's (which keeps norms and biases whole)."""
    work = Workload.of(load_config(None, ["model=gpt-1m", "train.global_batch=8", "train.seq_len=64"]))
    one, grid = work.share(Layout()), work.share(Layout(tp=4, tp_mode="2d"))
    assert (grid.block, grid.embed, grid.head) == (one.block // 4, one.embed // 4, one.head // 4)
    assert grid.block < work.share(Layout(tp=4)).block


LLAMA = [*DENSE, "model=hf:llama", "model.n_head=4", "hf.kv_heads=2", "hf.ffn=64"]  # grouped-query attention


@pytest.mark.parametrize(
    "preset,grids_expected",
    [
        (DENSE, True),
        (MOE, False),
        ([*DENSE, "model.tie_embeddings=true"], False),
        (LLAMA, True),
        ([*LLAMA, "model=hf:qwen3"], True),
        ([*LLAMA, "model=hf:phi3"], False),
    ],
)
def test_no_enumerated_2d_layout_is_one_the_runtime_refuses(preset, grids_expected):
    """A dense untied GPT or Hugging Face Llama on 8 devices gets 2 x 2 grids (ZeRO 0-3, no SP; dp=2, pp=2 or cp=2),
    each passing `problems()`; an MoE, a tied model or a family without a 2-D plan (Phi-3's fused qkv) none; Qwen3 (its
    per-head norms replicated) gets them."""
    cfg = load_config(None, preset)
    layouts = enumerate_layouts(Workload.of(cfg), 8, Space(**SCHEDULES), small_cluster(1.0))
    grids = [lay for lay in layouts if lay.tp_mode == "2d"]
    if not grids_expected:
        assert grids == []
        return
    assert grids and {lay.zero for lay in grids} == {0, 1, 2, 3} and all(lay.tp == 4 and not lay.sp for lay in grids)
    assert {lay.pp for lay in grids} == {1, 2} and {lay.cp for lay in grids} == {1, 2}
    assert [lay.describe() for lay in grids if refusals(cfg, lay, 8)] == []


@pytest.mark.parametrize("memory_gb", [1.0, 0.000266])
def test_search_finds_the_brute_force_optimum_with_2d_grids(memory_gb):
    """A dense model on 4 devices, 2-D grids beside 1-D tp, dp and pp; with ample memory and with memory so tight that
    only a grid (1/4 of every tensor, norms included) fits on the devices, the search's best is the brute-force best
    (then a grid)."""
    cfg = load_config(None, DENSE)
    cluster, space = small_cluster(memory_gb), Space(**SCHEDULES)
    best, everything = optimum(cfg, 4, cluster, space)
    assert {c.layout.tp_mode for c in everything} == {"1d", "2d"}
    found = search(Workload.of(cfg), cluster, 4, space, cfg=cfg, exact=0).ranked[0]
    assert found.step_seconds == pytest.approx(best.step_seconds, rel=1e-9), (found.layout.describe(), best.layout.describe())
    if memory_gb < 0.001:  # the lightest 1-D plan (tp=2 pp=2 sp, recomputing) needs 256 KB, a 2 x 2 grid's 250 KB
        assert found.layout.tp_mode == "2d" and not found.layout.offload.enabled, found.layout.describe()
