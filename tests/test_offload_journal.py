"""offload.commit=journal: an offloaded run's steps committed through a gradient log, so the scratch itself is resumable
at its last committed step. The journaled run equals the fused offload run and the in-memory run; a real `behemoth
train` killed (SIGKILL) before a step's commit or in the middle of its apply pass resumes onto the same curve and the
same final weights; a skipped non-finite step changes no weight; the disk check counts state + gradient log."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.common import CACHE, assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks

ON_DISK = ("offload.params=disk", "offload.optimizer=disk")
JOURNAL = (*ON_DISK, "offload.commit=journal")
STEPS = ("train.steps=4", "train.grad_clip=0", "train.eval_every=2")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """The same 4 steps journaled, fused into backward (hard-link checkpoints), and in memory."""
    root = tmp_path_factory.mktemp("journal")
    modes = {"journal": JOURNAL, "fused": (*ON_DISK, "offload.step=fused"), "memory": ()}
    out = {}
    for name, extra in modes.items():
        out[name] = run_ranks(1, train_body, tiny_config(root / name, *STEPS, "checkpoint.every=2", "checkpoint.keep=3", *extra))[0]
        out[name]["run_dir"] = str(root / name)
    return out


def test_a_journaled_run_equals_the_fused_offload_run_and_the_in_memory_run(runs):
    journal = runs["journal"]
    assert journal["losses"] == runs["fused"]["losses"], "the same arithmetic as the fused step: the same float32 losses"
    assert_close_runs(runs["fused"], journal, loss_rtol=0.0, weight_rtol=0.0, weight_atol=0.0)
    assert_close_runs(runs["memory"], journal)


def test_a_journaled_run_keeps_marker_checkpoints_and_links_only_its_last(runs):
    """Checkpoints before the last hold no model state (the scratch is the state); the last links the scratch, which the
    run then gives up: the run directory ends as a hard-link run's does."""
    root = Path(runs["journal"]["run_dir"])
    ckpts = root / "checkpoints"
    marker, last = ckpts / "step_0000002", ckpts / "step_0000004"
    assert not (marker / "scratch").exists() and sum(f.stat().st_size for f in marker.rglob("*") if f.is_file()) < 64 * 1024
    assert json.loads((marker / "meta.json").read_text())["journal"] is True and (ckpts / "step_0000000").is_dir()
    assert {p.parent.name for p in (last / "scratch").rglob("*.bin")} == {"params", "optimizer"}
    assert not (root / "offload-scratch").exists(), "the last checkpoint holds the state: the scratch is released"


def test_a_skipped_step_changes_no_weight(tmp_path):
    """train.nonfinite=skip with the journal (no fused step to refuse): a skipped step leaves every weight as it was."""
    from tests.test_offload_nonfinite import BLOW_UP, _problems

    assert not [m for m in _problems(*BLOW_UP, *JOURNAL, "train.nonfinite=skip") if "train.nonfinite" in m]
    skipped, unchanged, finite = run_ranks(1, _skip_body, tiny_config(tmp_path, *BLOW_UP, "train.nonfinite=skip", *JOURNAL))[0]
    assert skipped, "the learning rate must make some step non-finite for the test to test anything"
    assert unchanged and finite


def _skip_body(cfg_dict: dict[str, Any]) -> tuple[list[int], bool, bool]:
    import torch

    from behemoth.config import Config
    from behemoth.topology import init_runtime
    from behemoth.train import Trainer

    cfg = Config.model_validate(cfg_dict)
    rt = init_runtime(timeout_s=cfg.run.timeout_s)
    trainer = Trainer(cfg, rt)

    def weights() -> list[torch.Tensor]:
        return [t.clone() for v in trainer.engine.state_dict()["model"].values() for _, t in getattr(v, "_chunks", [((), v)])]

    skipped, unchanged = [], True
    try:
        for step in range(cfg.train.steps):
            before = weights()
            if trainer.train_one(step, 1.0).get("skipped"):
                skipped.append(step)
                unchanged = unchanged and all(torch.equal(a, b) for a, b in zip(before, weights()))
        return skipped, unchanged, all(bool(torch.isfinite(t).all()) for t in weights())
    finally:
        trainer.engine.close()
        rt.close()


def test_the_disk_check_counts_state_and_gradient_log_and_fits_5b_in_75_gib(tmp_path):
    """The 5.04B model (float32 masters and moments, a bf16 gradient log) needs state + log + units in flight + margin,
    under 75 GiB; with float32 gradients it does not fit, and the refusal names every part."""
    from behemoth.config import Config
    from behemoth.faults.preflight import GIB, journal_bytes, journal_disk_problems

    shape = ["model.n_layer=25", "model.d_model=4096", "model.n_head=32", "model.context=128", *JOURNAL, "offload.max_memory_gb=12"]
    bf16 = Config.model_validate(tiny_config(tmp_path, *shape, "parallel.param_dtype=bf16"))
    params = bf16.model.num_params()
    parts = journal_bytes(bf16)
    assert 5.0e9 < params < 5.1e9 and parts["state"] == 12 * params and parts["gradient log"] == 2 * params
    assert sum(parts.values()) < 75 * GIB, {k: v / GIB for k, v in parts.items()}
    fp32 = Config.model_validate(tiny_config(tmp_path, *shape))
    assert journal_bytes(fp32)["gradient log"] == 4 * params
    [refused] = journal_disk_problems(fp32, "/big", 75 * GIB, 0)
    assert "56.29 GiB state" in refused.message and "18.76 GiB gradient log" in refused.message and "gradient log" in refused.message, refused.message


def test_a_resume_counts_the_scratch_it_writes_over_as_free(tmp_path, monkeypatch):
    """A journaled run's resume finds its own scratch on the disk: what those files hold is reused, not needed again
    (a 5B resume was refused with 10 GiB free next to its 66 GiB of scratch)."""
    import shutil
    from collections import namedtuple

    from behemoth.config import Config
    from behemoth.faults import preflight
    from behemoth.faults.preflight import disk_problems, journal_bytes

    monkeypatch.setattr(preflight, "JOURNAL_MARGIN", 0)  # the tiny model's own bytes only
    run = tmp_path / "run"
    cfg = Config.model_validate(tiny_config(tmp_path, *JOURNAL, f"run.dir={run}"))
    need = sum(journal_bytes(cfg).values())
    assert need < 64 * 2**20
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10 * need, 9 * need, need // 2))
    assert disk_problems(cfg, str(run))  # a fresh run: half of what it needs is free
    scratch = cfg.offload.scratch_dir(str(run)) / "rank0"
    scratch.mkdir(parents=True)
    (scratch / "unit.bin").write_bytes(os.urandom(need // 2 + 1))  # the earlier attempt's files, really allocated
    assert disk_problems(cfg, str(run)) == []


def test_journal_needs_every_state_on_disk_and_no_fused_step():
    from tests.test_offload_nonfinite import _problems

    found = _problems("offload.params=disk", "offload.commit=journal", "offload.step=fused")
    assert any("offload.optimizer=device" in m for m in found) and any("offload.step=fused with offload.commit=journal" in m for m in found)


# --- a real `behemoth train` killed and resumed (slow: six processes) ---

CLI_STEPS = (*STEPS, "checkpoint.every=2", "checkpoint.export=true", "train.log_every=1")


def behemoth_train(run_dir: Path, *args: str, kill: str | None = None) -> subprocess.CompletedProcess:
    """`behemoth train` in its own process (BEHEMOTH_JOURNAL_KILL: where it SIGKILLs itself)."""
    env = {k: v for k, v in os.environ.items() if k != "BEHEMOTH_JOURNAL_KILL"} | {"OMP_NUM_THREADS": "1"}
    env |= {"BEHEMOTH_JOURNAL_KILL": kill} if kill else {}
    cmd = [sys.executable, "-m", "behemoth", "train", "--nproc", "1", *args, *_cli_overrides(run_dir)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _cli_overrides(run_dir: Path) -> list[str]:
    base = ["model=gpt-tiny", "train.global_batch=8", "train.seq_len=32", "train.lr=3e-3", "train.warmup_steps=2", "train.eval_batches=1"]
    quiet = ["train.peak_tflops=1", "run.progress=false", "run.tensorboard=false", "run.timeout_s=60", f"data.cache_dir={CACHE}"]
    return [*base, *quiet, *CLI_STEPS, *JOURNAL, f"run.dir={run_dir}"]


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("cli") / "whole"
    done = behemoth_train(run_dir)
    assert done.returncode == 0, done.stderr[-2000:]
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before-commit:3", "mid-apply:3"])
def test_a_killed_run_resumes_onto_the_same_curve_and_weights(uninterrupted, tmp_path, point):
    """SIGKILL at step 3 (after a marker checkpoint at 2): before the commit the scratch is step 2; in the apply pass
    (a unit recorded applied, not yet renamed) the resume finishes step 3 from the log. Either way the curve and the final
    weights are the uninterrupted run's, bit for bit."""
    from safetensors.torch import load_file

    run_dir = tmp_path / "killed"
    killed = behemoth_train(run_dir, kill=point)
    assert killed.returncode in (-9, 137), (killed.returncode, killed.stderr[-2000:])
    left = run_dir / "offload-scratch" / "rank0" / ("applied.log" if point.startswith("mid") else "state.pt")
    assert max(losses(run_dir)) == 2 and left.is_file(), "killed in step 3, where the test hook says"
    resumed = behemoth_train(run_dir, "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert losses(run_dir) == losses(uninterrupted), (losses(run_dir), losses(uninterrupted))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    event = next(r for r in rows if r.get("event") == "resume")
    assert event["step"] == (2 if point.startswith("before") else 3), event
    want, got = load_file(uninterrupted / "model.safetensors"), load_file(run_dir / "model.safetensors")
    assert want.keys() == got.keys() and all(bool((want[k] == got[k]).all()) for k in want)
    assert all(math.isfinite(v) for v in losses(run_dir).values())


@pytest.mark.slow
def test_two_journaled_ranks_equal_the_single_process_run(runs, tmp_path):
    """Data parallelism over two ranks, each committing its own shards' journal (the ranks agree before any applies)."""
    got = run_ranks(2, train_body, tiny_config(tmp_path, *STEPS, "checkpoint.every=2", *JOURNAL))[0]
    assert_close_runs(runs["memory"], got)


@pytest.mark.slow
def test_8bit_moments_journal_as_the_fused_step_does(tmp_path):
    """offload.optimizer_bits=8: codes and block scales are written beside their files and renamed in like float32 moments."""
    eight = ("offload.optimizer_bits=8", *STEPS)
    journal = run_ranks(1, train_body, tiny_config(tmp_path / "journal", *eight, *JOURNAL))[0]
    fused = run_ranks(1, train_body, tiny_config(tmp_path / "fused", *eight, *ON_DISK, "offload.step=fused"))[0]
    assert journal["losses"] == fused["losses"]
    assert_close_runs(fused, journal, loss_rtol=0.0, weight_rtol=0.0, weight_atol=0.0)
