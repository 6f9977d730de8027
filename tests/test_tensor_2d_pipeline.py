"""2-D, 2.5-D and 3-D tensor parallelism under a pipeline (parallel.pp=2) equal the single process: stages exchange
each rank's block of the residual stream ([batch / rows, T, h / q]) with the rank at the same grid position of the
next stage, and the last stage's grid (or Tesseract, or cube) computes the loss. 8 gloo ranks per 2-D run (pp=2 x a
2 x 2 grid), 16 per 2.5-D or 3-D one; float32, all slow."""

from __future__ import annotations

import pytest

from tests.common import assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks

STEPS = ["train.micro_batch=2", "train.steps=3", "train.eval_every=3", "checkpoint.every=3"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_pp2_tp2d_equals_single_process(tmp_path, schedule):
    """pp=2 x a 2 x 2 grid: the single-process losses (rtol 1e-5) and exported weights (rtol 1e-4) after 3 steps."""
    ref = run_ranks(1, train_body, tiny_config(tmp_path / "ref", *STEPS))[0]
    extra = ["parallel.tp=4", "parallel.tp_mode=2d", "parallel.pp=2", f"parallel.schedule={schedule}"]
    got = run_ranks(8, train_body, tiny_config(tmp_path / "pp2d", *STEPS, *extra), timeout=400)
    assert_close_runs(ref, got[0])
    assert all(r["losses"] == got[0]["losses"] for r in got), "ranks disagree on the loss"


@pytest.mark.slow
@pytest.mark.parametrize("layout", [("parallel.tp_mode=2.5d", "parallel.tp_depth=2"), ("parallel.tp_mode=3d",)], ids=["2.5d", "3d"])
def test_pp2_tp8_25d_and_3d_equal_single_process(tmp_path, layout):
    """pp=2 x 8 tp ranks (16 processes): a 2 x 2 x 2 Tesseract or cube per stage, the single-process losses and weights
    after 2 steps (micro-batches of 4 sequences: 2.5-D's d*q and 3-D's q^2 blocks)."""
    steps = ["train.micro_batch=4", "train.steps=2", "train.eval_every=2", "checkpoint.every=2"]
    ref = run_ranks(1, train_body, tiny_config(tmp_path / "ref", *steps))[0]
    got = run_ranks(16, train_body, tiny_config(tmp_path / "pp", *steps, "parallel.tp=8", "parallel.pp=2", *layout), timeout=500)
    assert_close_runs(ref, got[0])
