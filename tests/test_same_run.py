"""The same run after a resume, bit for bit (dropout included), from checkpoints saved in the background or not; a
non-finite loss stops the run without a checkpoint, or is skipped by policy."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from behemoth.metrics import read_metrics
from tests.common import tiny_config, train_body
from tests.dist import run_ranks


@pytest.mark.parametrize(
    "extra", [["model.dropout=0.1"], ["model.dropout=0.1", "checkpoint.async_save=false"]], ids=["background-save", "synchronous-save"]
)
def test_resume_with_dropout_is_bit_for_bit(tmp_path, extra):
    """12 steps with dropout 0.1 on 2 processes; resumed at step 6 on 2 processes: every loss and weight identical."""
    full_dir = tmp_path / "full"
    full = run_ranks(2, train_body, tiny_config(full_dir, "checkpoint.every=6", *extra))[0]
    copy = tmp_path / "resumed"
    shutil.copytree(full_dir, copy)
    resumed = run_ranks(2, train_body, tiny_config(copy, "checkpoint.every=6", *extra), str(copy / "checkpoints/step_0000006"))[0]
    assert resumed["start"] == 6
    assert resumed["losses"] == full["losses"][6:], (resumed["losses"], full["losses"][6:])
    for name, weight in full["weights"].items():
        assert torch.equal(weight, resumed["weights"][name]), name
    without_dropout = run_ranks(2, train_body, tiny_config(tmp_path / "nodrop", "checkpoint.every=0"))[0]
    assert without_dropout["losses"][6:] != full["losses"][6:]  # dropout does act: the comparison above could fail


def test_background_and_synchronous_saves_hold_the_same_tensors(tmp_path):
    """The copy a background save writes is the state at its step, exactly as a synchronous save writes it."""
    for mode in ("true", "false"):
        run_ranks(2, train_body, tiny_config(tmp_path / mode, "train.steps=6", "checkpoint.every=3", f"checkpoint.async_save={mode}"))
    background, synchronous = (load_file(str(tmp_path / mode / "model.safetensors")) for mode in ("true", "false"))
    assert background.keys() == synchronous.keys() and all(torch.equal(background[k], synchronous[k]) for k in background)
    rows = [r for r in read_metrics(tmp_path / "true" / "metrics.jsonl") if "ckpt_stall_s" in r]
    assert [r["step"] for r in rows] == [3, 6] and all(r["ckpt_stall_s"] >= 0 for r in rows)


def test_a_nonfinite_loss_stops_the_run_without_a_checkpoint(tmp_path):
    """A learning rate of 1e20 makes the loss non-finite at step 2: the run stops in one line naming the step, the update
    is not applied and the only checkpoint is step 1's."""
    run_dir = tmp_path / "nan"
    with pytest.raises(
        AssertionError,
        match=r"BehemothError: step 2: the loss is (nan|inf) and the gradient norm (nan|inf): "
        r"training stopped without applying the update or writing a checkpoint; resume from ",
    ):
        run_ranks(2, train_body, tiny_config(run_dir, "train.lr=1e20", "train.warmup_steps=0", "checkpoint.every=1"))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_0000001"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_0000001"]


def test_nonfinite_steps_are_skipped_by_policy(tmp_path):
    run_dir = tmp_path / "skip"
    result = run_ranks(1, train_body, tiny_config(run_dir, "train.lr=1e20", "train.warmup_steps=0", "train.steps=4", "train.nonfinite=skip"))[0]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert not rows[0].get("skipped") and all(r.get("skipped") for r in rows[1:]), rows
    assert len(result["losses"]) == 4
