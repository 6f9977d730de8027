"""A mixture of experts with offloaded model states: each block's experts stream with its ZeRO-3 unit on the host or
disk tier (parallel.ep=1) and the run trains the single-process curve (loss and final weights, float32)."""

from __future__ import annotations

import pytest

from tests.common import assert_close_runs, tiny_config
from tests.dist import run_ranks
from tests.test_composition import BASE, CORPUS, MOE, reference_config, train_plans


def offload_config(run_dir, tier: str, *extra: str):
    return tiny_config(run_dir, f"data.path={CORPUS}", *BASE, *MOE, f"offload.params={tier}", f"offload.optimizer={tier}", *extra)


@pytest.mark.parametrize("tier", ["disk"])
def test_moe_offload_trains_the_single_process_curve(tmp_path, tier):
    cfgs = [reference_config(True, tmp_path / "moe"), offload_config(tmp_path / tier, tier)]
    ref, got = run_ranks(1, train_plans, cfgs, timeout=240)[0]
    assert_close_runs(ref, got)


def test_moe_offload_over_ep_trains_the_single_process_curve(tmp_path):
    """ep=2: each rank streams its own experts' units (over dp) and the dense units over dp x ep."""
    ref = run_ranks(1, train_plans, [reference_config(True, tmp_path / "moe")], timeout=120)[0][0]
    got = run_ranks(2, train_plans, [offload_config(tmp_path / "ep2", "disk", "parallel.ep=2")], timeout=240)[0][0]
    assert_close_runs(ref, got)
