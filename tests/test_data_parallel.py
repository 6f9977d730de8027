"""Data parallelism equals the single-process run: per-step loss and final weights."""

from __future__ import annotations

import pytest

from tests.common import assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cfg = tiny_config(tmp_path_factory.mktemp("ref"))
    return run_ranks(1, train_body, cfg)[0]


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_matches_single_process(world, reference, tmp_path):
    got = run_ranks(world, train_body, tiny_config(tmp_path))
    assert_close_runs(reference, got[0])
    assert all(r["losses"] == got[0]["losses"] for r in got), "ranks disagree on the loss"


def test_reference_loss_falls(reference):
    first, last = reference["val"][0][1], reference["val"][-1][1]
    assert last < first - 0.3, f"validation loss did not fall: {first} -> {last}"


def test_gradient_accumulation_equals_large_micro_batch(tmp_path):
    """4 micro-steps of 2 sequences == 1 step of 8, on 1 process and on 2 (2 x 2 x 2)."""
    big = run_ranks(1, train_body, tiny_config(tmp_path / "big", "train.micro_batch=8"))[0]
    accum = run_ranks(1, train_body, tiny_config(tmp_path / "acc", "train.micro_batch=2"))[0]
    assert_close_runs(big, accum)
    dp_accum = run_ranks(2, train_body, tiny_config(tmp_path / "dpacc", "train.micro_batch=2"))[0]
    assert_close_runs(big, dp_accum)


def test_missing_all_reduce_would_be_caught(tmp_path, monkeypatch):
    """The tolerance is tight enough: ranks that never reduce gradients diverge far beyond it."""
    got = run_ranks(2, _train_without_reduce, tiny_config(tmp_path / "broken"))[0]
    ref = run_ranks(1, train_body, tiny_config(tmp_path / "ok"))[0]
    with pytest.raises(AssertionError):
        assert_close_runs(ref, got)


def _train_without_reduce(cfg_dict):
    from behemoth.parallel import data

    data.DataParallel._launch = lambda self, bucket: None
    return train_body(cfg_dict)


def test_bf16_autocast_trains(tmp_path):
    """bf16 is for GPUs (slow on this CPU): two steps of the tiny model just have to run and stay finite."""
    got = run_ranks(1, train_body, tiny_config(tmp_path, "train.precision=bf16", "train.steps=2"))[0]
    assert len(got["losses"]) == 2 and all(5.0 < loss < 6.0 for loss in got["losses"])
