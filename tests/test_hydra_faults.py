"""A hydra sweep in which trials fail (a RuntimeError inside a shard, as a device out-of-memory raises; a worker killed
as the kernel's OOM killer kills, with another trial's task prefetched in it): each failed trial is reported with its
error (the leaderboard, its train.log with the worker's traceback), its spilled shards are let go, and the others end
with exactly the losses they have alone. Every trial leaves what the other execution modes leave in its directory."""

from __future__ import annotations

import re

import pytest
from safetensors.torch import load_file

from behemoth.cli import main
from behemoth.metrics import tensorboard_available
from tests.test_hydra import deadline
from tests.test_sweep_run import alone, base, corpus, csv_rows, curve, run_killed, write_sweep  # noqa: F401 - corpus is a fixture

FAULTS = "trial-000:validate:kill,trial-001:backward:raise"  # trial-000's first task, trial-001's first backward


@pytest.fixture(scope="module")
def failing_sweep(corpus, tmp_path_factory):  # noqa: F811
    """Three trials of a 2-block GPT (4 shards each, spilled to disk) on one worker, which holds two tasks at once: when
    trial-000's first task kills it, trial-001's first task is prefetched there."""
    root = tmp_path_factory.mktemp("faults")
    cfg = base(corpus, 3, model={"preset": "gpt-tiny", "n_layer": 2}, train={"eval_every": 3})
    sweep = {"dir": str(root / "sweep"), "execution": "hydra", "hydra": {"budget_mb": 0.4, "spill": "disk"}}
    path = write_sweep(root / "faults.yaml", sweep, cfg, list=[{"train.lr": lr} for lr in (0.01, 0.003, 0.001)])
    with pytest.MonkeyPatch.context() as mp, deadline(300):
        mp.setenv("BEHEMOTH_HYDRA_FAULT", FAULTS)  # the workers the sweep spawns inherit it
        code = main(["sweep", str(path), "--nproc", "1"])
    return root, code


def test_failed_trials_are_reported_and_the_others_train_as_alone(failing_sweep):
    root, code = failing_sweep
    sweep = root / "sweep"
    assert code == 1
    rows = {r["trial"]: r["status"] for r in csv_rows(sweep / "leaderboard.csv")}
    assert rows["trial-000"] == "failed: hydra worker 0 died (killed by SIGKILL) running shard 0 validate at step 0"
    assert rows["trial-001"] == "failed: shard 2 backward of step 1: RuntimeError: BEHEMOTH_HYDRA_FAULT: trial-001's backward task failed as asked"
    assert rows["trial-002"] == "done"
    expected = alone(sweep / "trial-002", root / "alone")
    assert curve(sweep / "trial-002") == expected and len(expected[0]) == 3  # every loss, exactly
    log = (sweep / "sweep.log").read_text()
    assert "sweep: trial-001 failed before step 3" in log and "sweep: trial-002 done: trained to step 3" in log
    trace = (sweep / "trial-001" / "train.log").read_text()
    assert "Traceback" in trace and "fault_point" in trace  # the worker's traceback, where the trial's own run prints it
    for trial in ("trial-000", "trial-001", "trial-002"):
        assert not (sweep / trial / "hydra" / "spill").exists(), trial  # a trial done or failed lets its spilled shards go


def test_every_trial_leaves_what_its_own_run_leaves(failing_sweep):
    """loss.png, metrics.jsonl, config.yaml, TensorBoard's events (when installed) and train.log, as in the sequential
    and concurrent modes; the failed trial's too, up to where it failed."""
    root, _ = failing_sweep
    trial = root / "sweep" / "trial-002"
    assert (trial / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (trial / "config.yaml").is_file() and (trial / "metrics.jsonl").is_file()
    assert bool(list(trial.glob("events.out.tfevents.*"))) == tensorboard_available()
    lines = (trial / "train.log").read_text().splitlines()
    assert lines[0].startswith("behemoth: hydra: gpt-tiny (") and "4 shards" in lines[0] and "steps 0 -> 3" in lines[0]
    assert any(line.startswith("behemoth: done: validation loss 5.5") and "(step 3)" in line for line in lines)
    failed = root / "sweep" / "trial-001"
    assert (failed / "loss.png").is_file() and "behemoth: error: shard 2 backward of step 1" in (failed / "train.log").read_text()


@pytest.mark.slow  # a sweep killed mid-trial and resumed, then the trial alone: ~30 s on a loaded 2-core machine
def test_killed_hydra_trial_resumes_from_its_last_checkpoint(corpus, tmp_path):  # noqa: F811
    """checkpoint.every inside a hydra segment: killed after a mid-trial save (steps 3, 6, ... carry optimizer steps
    the shards take only when next loaded), the resumed trial continues from there and ends with exactly the losses and
    weights of the trial alone."""
    cfg = base(corpus, 16, model={"preset": "gpt-tiny", "n_layer": 2}, train={"eval_every": 4}, checkpoint={"every": 3, "export": True})
    sweep = {"dir": str(tmp_path / "sweep"), "execution": "hydra", "hydra": {"budget_mb": 0.4}}
    path = write_sweep(tmp_path / "resume.yaml", sweep, cfg)
    trial = tmp_path / "sweep" / "trial-000"
    run_killed(path, trial / "hydra" / "latest")
    assert main(["sweep", str(path), "--resume"]) == 0
    resumed = re.search(r"sweep: trial-000 resumes at step (\d+) -> step 16", (tmp_path / "sweep" / "sweep.log").read_text())
    assert resumed and 3 <= int(resumed[1]) < 16 and int(resumed[1]) % 3 == 0
    (train, val), (train_alone, val_alone) = curve(trial), alone(trial, tmp_path / "alone")
    assert train == train_alone and len(train) == 16  # every loss, exactly
    assert [v for v in val if v[0] in dict(val_alone)] == val_alone  # (the resumed run validates at its start too)
    ours, theirs = load_file(trial / "model.safetensors"), load_file(tmp_path / "alone" / "model.safetensors")
    assert all(ours[name].equal(t) for name, t in theirs.items())
