"""Checkpoints: resume continues the same curve (also on another process count), writes are atomic,
damaged or foreign checkpoints are refused with one line (every damage class: tests/test_integrity.py)."""

from __future__ import annotations

import shutil

import pytest

from behemoth.errors import BehemothError
from behemoth.faults.checkpoint import resolve_checkpoint, validate_checkpoint
from behemoth.metrics import read_metrics
from tests.common import assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks

CKPT6 = "checkpoints/step_0000006"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """12 steps on 2 processes, checkpointing every 6."""
    run_dir = tmp_path_factory.mktemp("full")
    result = run_ranks(2, train_body, tiny_config(run_dir, "checkpoint.every=6", "checkpoint.keep=3"))[0]
    return run_dir, result


def _tail(result, start):
    return {"losses": result["losses"][start:], "weights": result["weights"]}


@pytest.mark.parametrize("world", [2, 1, 4])
def test_resume_continues_the_curve(uninterrupted, tmp_path, world):
    run_dir, full = uninterrupted
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    resumed = run_ranks(world, train_body, tiny_config(copy, "checkpoint.every=6", "checkpoint.keep=3"), str(copy / CKPT6))[0]
    assert resumed["start"] == 6 and len(resumed["losses"]) == 6
    assert_close_runs(_tail(full, 6), resumed)
    (step, restored), original = resumed["val"][0], dict(full["val"])[6]  # the restored model is validated first
    assert step == 6 and abs(restored - original) <= 1e-5 * original, (restored, original)
    rows = [r for r in read_metrics(copy / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in rows] == [0, 6, 12], "the resumed log keeps one validation record per step"


def test_checkpoint_meta_and_files(uninterrupted):
    run_dir, _ = uninterrupted
    ckpt = resolve_checkpoint(run_dir)
    assert ckpt.name == "step_0000012"
    meta = validate_checkpoint(ckpt, tiny_config(run_dir)["model"])
    assert meta["step"] == 12 and meta["world_size"] == 2
    assert sorted(p.name for p in (ckpt / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]
    assert (run_dir / "model.safetensors").exists() and (run_dir / "loss.png").exists()


def test_crash_while_writing_leaves_previous_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(AssertionError, match="simulated crash"):
        run_ranks(2, _train_crashing_on_second_save, tiny_config(run_dir, "checkpoint.every=6"))
    assert (run_dir / "checkpoints" / "step_0000012.partial").is_dir()
    ckpt = resolve_checkpoint(run_dir)
    assert ckpt.name == "step_0000006"
    validate_checkpoint(ckpt, tiny_config(run_dir)["model"])
    resumed = run_ranks(2, train_body, tiny_config(run_dir, "checkpoint.every=6"), str(ckpt))[0]
    assert resumed["start"] == 6 and not (run_dir / "checkpoints" / "step_0000012.partial").exists()


def _train_crashing_on_second_save(cfg_dict):
    from behemoth.faults import checkpoint

    real_save, calls = checkpoint.dcp.save, []

    def save(*args, **kwargs):
        real_save(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated crash after the tensors were written")

    checkpoint.dcp.save = save
    return train_body(cfg_dict)


def test_corrupt_checkpoint_is_refused(uninterrupted, tmp_path):
    run_dir, _ = uninterrupted
    model = tiny_config(run_dir)["model"]
    damages = [
        (lambda c: next(c.glob("*.distcp")).write_bytes(next(c.glob("*.distcp")).read_bytes()[:100]), r"is damaged: .*distcp has 100 bytes"),
        (lambda c: (c / ".metadata").write_bytes(b"garbage"), r"is damaged: .metadata has 7 bytes"),
        (lambda c: (c / "meta.json").write_text("{"), "meta.json is not readable JSON"),
    ]
    for i, (harm, message) in enumerate(damages):
        copy = tmp_path / f"ckpt{i}"
        shutil.copytree(run_dir / CKPT6, copy)
        harm(copy)
        with pytest.raises(BehemothError, match=message):
            validate_checkpoint(copy, model)


def test_checkpoint_of_another_model_is_refused(uninterrupted):
    run_dir, _ = uninterrupted
    other = tiny_config(run_dir, "model.n_layer=3")["model"]
    with pytest.raises(BehemothError, match=r"different model \(model.n_layer: checkpoint 2, config 3\)"):
        validate_checkpoint(resolve_checkpoint(run_dir), other)


def test_missing_checkpoint_is_refused(tmp_path):
    with pytest.raises(BehemothError, match="no checkpoint found"):
        resolve_checkpoint(tmp_path)


def test_tied_weight_is_exported_once(tmp_path):
    """An LM head tied to the embedding is one tensor: written once, under the embedding's name."""
    from safetensors.torch import load_file

    run_ranks(1, train_body, tiny_config(tmp_path, "model.tie_embeddings=true", "train.steps=2"))
    weights = load_file(str(tmp_path / "model.safetensors"))
    assert "wte.weight" in weights and "lm_head.weight" not in weights
