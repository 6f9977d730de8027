"""The sweep benchmark's DeepSpeed peer (benchmarks/sweep_deepspeed.py) trains what `behemoth train` trains: the same
per-step losses and validation loss for a trial of the sweep, under ZeRO-2 on 2 ranks. Needs the `bench` extra."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from behemoth.cli import main
from tests.test_sweep_run import base, corpus, curve  # noqa: F401 - corpus is a fixture

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_deepspeed_peer_ends_on_the_trials_own_curve(tmp_path, corpus):  # noqa: F811
    pytest.importorskip("deepspeed")
    config = tmp_path / "base.yaml"
    config.write_text(yaml.safe_dump({**base(corpus, 6), "run": {"progress": False}}))
    lrs = (3e-3, 9e-3)
    ours = []
    for i, lr in enumerate(lrs):
        assert main(["train", "--nproc", "1", "--config", str(config), f"train.lr={lr}", f"run.dir={tmp_path / f'run{i}'}"]) == 0
        ours.append(curve(tmp_path / f"run{i}"))
    out = tmp_path / "ds.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}
    script = str(ROOT / "benchmarks" / "sweep_deepspeed.py")
    argv = ["--config", str(config), "--lrs", ",".join(map(str, lrs)), "--stage", "2", "--out", str(out)]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script]
    subprocess.run([*launch, *argv], env=env, check=True, timeout=900)
    theirs = json.loads(out.read_text())["trials"]
    for (train, val), trial in zip(ours, theirs, strict=True):
        assert trial["losses"] == pytest.approx([loss for _, loss in train], rel=1e-5)
        assert trial["val_loss"] == pytest.approx(val[-1][1], rel=1e-5)
    assert theirs[0]["losses"][-1] != pytest.approx(theirs[1]["losses"][-1], rel=1e-3)  # the learning rate reached each trial
