"""The search's dimensions for MoE models: sequence parallelism (the MoE layer runs on the gathered sequence) and its
memory against the engine's measured peak, the enumeration never proposing what the runtime refuses, and the search
against brute force."""

from __future__ import annotations

import pytest

from behemoth.config import load_config
from behemoth.planner.layout import Workload
from behemoth.planner.search import Space, enumerate_layouts, refusals, search
from tests.test_planner_memory import mismatches
from tests.test_planner_search_dims import MOE, SCHEDULES, brute_force, optimum, small_cluster

TINY_MOE = ("model=gpt-moe-tiny", "train.seq_len=32")
MOE_GRID = {
    2: [
        (*TINY_MOE, "parallel.tp=2", "parallel.sequence_parallel=true"),
        (*TINY_MOE, "parallel.tp=2"),
        (*TINY_MOE, "parallel.zero_stage=2", "model.d_model=64", "model.n_head=4"),
        (*TINY_MOE, "parallel.cp=2", "parallel.cp_mode=ring"),
        (*TINY_MOE, "parallel.cp=2", "parallel.cp_mode=ulysses", "parallel.zero_stage=1"),
    ],
}


@pytest.mark.parametrize("world", sorted(MOE_GRID))
def test_predicted_memory_of_moe_plans_matches_measured(world, tmp_path):
    """The MoE layer's saved rows, router and stacked expert gradients (planner/moe_memory.py), under tp with and
    without SP, at ZeRO-2 and under cp (expert states sharded over dp x cp): the predicted peak within 5% of the
    measured one (measured within 1.3%)."""
    assert mismatches(world, MOE_GRID[world], tmp_path) == []


def test_moe_layouts_include_sequence_parallelism_and_the_runtime_accepts_them():
    """An MoE model on 4 devices: SP is enumerated with tp > 1, and every layout that uses it passes `problems()`."""
    cfg = load_config(None, MOE)
    layouts = enumerate_layouts(Workload.of(cfg), 4, Space(**SCHEDULES), small_cluster(1.0))
    sp = [lay for lay in layouts if lay.sp]
    assert sp and all(lay.tp == 2 for lay in sp)  # two heads: tp <= 2
    assert [lay.describe() for lay in sp if refusals(cfg, lay, 4)] == []


def test_search_finds_the_brute_force_optimum_with_sequence_parallel_experts():
    """tp pinned to 2 on 2 devices with memory so tight that a plain plan fits only recomputing: the search's best is
    the brute-force best, and it is the SP plan that fits without recomputing."""
    cfg = load_config(None, MOE)
    work, space = Workload.of(cfg), Space(**SCHEDULES, tp=(2,), pp=(1,))
    roomy = brute_force(cfg, 2, small_cluster(1.0), space)
    plain = min(c.peak_memory for c in roomy if not c.layout.sp and not c.layout.recompute)
    sp = min(c.peak_memory for c in roomy if c.layout.sp and not c.layout.recompute)
    assert sp < plain
    cluster = small_cluster((sp + plain) / 2 / 0.95 / 1e9)  # the lightest SP plan fits within the margin, no plain one
    best, everything = optimum(cfg, 2, cluster, space)
    assert all(c.layout.recompute for c in everything if not c.layout.sp) and any(not c.layout.sp for c in everything)
    found = search(work, cluster, 2, space, cfg=cfg, exact=0).ranked[0]
    assert found.layout.sp and not found.layout.recompute and found.step_seconds == pytest.approx(best.step_seconds, rel=1e-9), (
        found.layout.describe(),
        best.layout.describe(),
    )


@pytest.mark.parametrize("routing", [("model.moe.capacity_factor=1.25",), ("model.moe.noise=jitter",)])
def test_no_cp_layout_of_an_moe_model_routed_under_a_capacity_or_noise(routing):
    """A capacity fills over whole sequences and noise would differ per cp rank (`context_problems`): no cp layout."""
    cfg = load_config(None, [*MOE, *routing])
    assert {lay.cp for lay in enumerate_layouts(Workload.of(cfg), 4, Space(**SCHEDULES), small_cluster(1.0))} == {1}


@pytest.mark.parametrize("memory_gb", [1.0, 0.0012])
def test_search_finds_the_brute_force_optimum_with_context_parallel_experts(memory_gb):
    """A dropless 4-expert model of 2 sequences on 4 devices: cp in {1, 2, 4} beside ep, dp, tp and pp; the search's best
    is the brute-force best over every layout, recompute set and stage boundary."""
    cfg = load_config(None, ["model=gpt-moe-tiny", "train.global_batch=2", "train.seq_len=32"])
    cluster, space = small_cluster(memory_gb), Space(**SCHEDULES)
    best, everything = optimum(cfg, 4, cluster, space)
    assert {c.layout.cp for c in everything} == {1, 2, 4} and any(c.layout.cp > 1 and c.layout.ep > 1 for c in everything)
    found = search(Workload.of(cfg), cluster, 4, space, cfg=cfg, exact=0).ranked[0]
    assert found.step_seconds == pytest.approx(best.step_seconds, rel=1e-9), (found.layout.describe(), best.layout.describe())
