"""2.5-D and 3-D tensor parallelism under ZeRO-3: dp=2 x a 2 x 2 x 2 Tesseract or cube (16 gloo ranks), each rank's
grid-split pieces sharded over its dp group as ZeRO-3 units, equal the single process; a control that skips the
2.5-D depth sum shows the comparison would catch a missing reduction. float32, all slow."""

from __future__ import annotations

import pytest

from tests.common import assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks

STEPS = ["train.steps=3", "train.eval_every=3", "checkpoint.every=3", "train.micro_batch=4"]
LAYOUTS = {"2.5d": ["parallel.tp_mode=2.5d", "parallel.tp_depth=2"], "3d": ["parallel.tp_mode=3d"]}
ZERO3 = ["parallel.tp=8", "parallel.zero_stage=3"]  # dp = 16 / 8 = 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, 3 steps of 8 sequences in 2 micro-batches of 4."""
    return run_ranks(1, train_body, tiny_config(tmp_path_factory.mktemp("ref"), *STEPS))[0]


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(LAYOUTS))
def test_dp2_zero3_on_a_tesseract_or_cube_equals_single_process(reference, tmp_path, mode):
    """dp=2 x 8 tp ranks with ZeRO-3: the single-process losses (rtol 1e-5) and exported weights (rtol 1e-4)."""
    got = run_ranks(16, train_body, tiny_config(tmp_path / mode, *STEPS, *ZERO3, *LAYOUTS[mode]), timeout=600)
    assert_close_runs(reference, got[0])
    assert all(r["losses"] == got[0]["losses"] for r in got), "ranks disagree on the loss"


@pytest.mark.slow
def test_missing_depth_sum_under_zero3_would_be_caught(reference, tmp_path):
    """2.5-D under ZeRO-3 whose gradient shards are not summed over the depth (each layer keeps its half of the
    batch's gradient): far outside the tolerance."""
    got = run_ranks(16, _train_without_depth_sum, tiny_config(tmp_path / "bug", *STEPS, *ZERO3, *LAYOUTS["2.5d"]), timeout=600)[0]
    with pytest.raises(AssertionError):
        assert_close_runs(reference, got)


def _train_without_depth_sum(cfg_dict):
    from behemoth.parallel.tensor.twod import TensorParallel2D

    TensorParallel2D.finish_grads = lambda self, slices: None  # gpt-tiny has no replicated pieces: only the depth sum goes
    return train_body(cfg_dict)
