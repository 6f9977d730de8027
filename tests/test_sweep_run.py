"""`behemoth sweep` end to end on the tiny GPT: successive halving stops exactly the trials it should and a promoted
trial ends with the losses of the same trial run alone; a crashing trial is reported without stopping the others; a
killed sweep resumes; every trial of a concurrent (or Ray) sweep ends with exactly the losses it has alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from behemoth.cli import main
from tests.chaos import reaped
from tests.common import CACHE


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small text corpus (a few stdlib modules): tokenized in a blink, unlike the whole stdlib."""
    import argparse as a
    import json as j
    import textwrap as t

    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("".join(Path(m.__file__).read_text() for m in (a, j.decoder, j.encoder, t)))
    return path


def base(corpus: Path, steps: int, **sections) -> dict:
    tiny = {
        "model": {"preset": "gpt-tiny"},
        "train": {"steps": steps, "global_batch": 8, "seq_len": 32, "eval_every": 4, "eval_batches": 1, "warmup_steps": 2, "peak_tflops": 1},
        "checkpoint": {"every": 0, "export": False},
        "data": {"path": str(corpus), "cache_dir": str(CACHE)},
    }
    return {k: {**v, **sections.get(k, {})} for k, v in tiny.items()}


def write_sweep(path: Path, sweep: dict, base_config: dict, **parts) -> Path:
    path.write_text(yaml.safe_dump({"sweep": sweep, "base": base_config, **parts}))
    return path


def curve(run_dir: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(step, training loss) and (step, validation loss) as the run's metrics.jsonl has them, the last record of a step kept."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r["loss"] for r in rows if "loss" in r}
    val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    return sorted(train.items()), sorted(val.items())


def alone(trial_dir: Path, out: Path) -> tuple[list, list]:
    """The trial's own config trained in one uninterrupted run elsewhere."""
    assert main(["train", "--nproc", "1", "--config", str(trial_dir / "trial.yaml"), f"run.dir={out}"]) == 0
    return curve(out)


def run_killed(path: Path, first_checkpoint: Path) -> None:
    """`behemoth sweep` in a session of its own, SIGKILLed (sweep, slot and trial at once) once `first_checkpoint` exists."""
    cmd = [sys.executable, "-m", "behemoth", "sweep", str(path), "--nproc", "1"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True
    )
    with reaped(proc):
        deadline = time.time() + 300
        while not first_checkpoint.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.time() < deadline, "no checkpoint in time"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def halved(corpus, tmp_path_factory):
    """ASHA over 4 learning rates (two learn nothing in 4 steps) and a trial that crashes; rungs at 4, 8, 16 steps. The
    sweep is killed while the second trial trains (it checkpoints every 2 steps) and resumed."""
    root = tmp_path_factory.mktemp("asha")
    trials = [{"train.lr": 0.01}, {"train.lr": 0.003}, {"train.lr": 1e-7}, {"train.lr": 2e-7}, {"data.path": str(root / "missing.txt")}]
    sweep = {"dir": str(root / "sweep"), "prune": {"method": "asha", "min_steps": 4, "reduction_factor": 2}}
    path = write_sweep(root / "asha.yaml", sweep, base(corpus, 16, checkpoint={"every": 2}), list=trials)
    run_killed(path, root / "sweep" / "trial-001" / "checkpoints" / "latest")
    first = (root / "sweep" / "trial-000" / "metrics.jsonl").read_bytes()
    code = main(["sweep", str(path), "--resume"])
    return root, code, first


def test_asha_stops_exactly_the_expected_trials(halved, capsys):
    root, code, _ = halved
    sweep = root / "sweep"
    assert code == 1  # one trial failed: the sweep says so in its exit status, after running every other trial
    reached = {t: max(s for s, _ in curve(sweep / t)[0]) for t in ("trial-000", "trial-001", "trial-002", "trial-003")}
    assert reached == {"trial-000": 16, "trial-001": 8, "trial-002": 4, "trial-003": 4}
    _, val0 = curve(sweep / "trial-000")
    _, val1 = curve(sweep / "trial-001")
    assert dict(val0)[8] < dict(val1)[8] and dict(val1)[4] < min(dict(curve(sweep / t)[1])[4] for t in ("trial-002", "trial-003"))
    rows = list(csv_rows(sweep / "leaderboard.csv"))
    order = [r["trial"] for r in rows]
    assert order[:2] == ["trial-000", "trial-001"] and order[-1] == "trial-004"  # best first, the failed trial last
    status = {r["trial"]: r["status"] for r in rows}
    assert status["trial-000"] == "done" and status["trial-001"] == "stopped at 8" and status["trial-002"] == "stopped at 4"
    assert status["trial-004"].startswith("failed: behemoth: error: ") and "missing.txt" in status["trial-004"]
    by_trial = {r["trial"]: r for r in rows}
    assert int(by_trial["trial-000"]["tokens"]) == 16 * 8 * 32 and float(by_trial["trial-000"]["best_val_loss"]) == pytest.approx(val0[-1][1])
    assert (sweep / "curves.png").stat().st_size > 10_000 and "| trial-000 | train.lr=0.01 " in (sweep / "leaderboard.md").read_text()


def csv_rows(path: Path):
    import csv

    with open(path) as f:
        yield from csv.DictReader(f)


def test_promoted_trial_ends_with_the_losses_it_has_alone(halved):
    root, _, _ = halved
    trial = root / "sweep" / "trial-000"
    rows = [json.loads(line) for line in (trial / "metrics.jsonl").read_text().splitlines()]
    assert [r["from"] for r in rows if r.get("event") == "resume"] == ["step_0000004", "step_0000008"]  # resumed at each rung
    assert curve(trial) == alone(trial, root / "alone")  # every step's loss and every validation loss, exactly


def test_killed_sweep_resumes(halved, capsys):
    """The kill came after the first trial's first rung and while the second trained: --resume kept the first trial's
    rung as it was, continued the second from its checkpoint, and ran no segment twice."""
    root, _, first = halved
    sweep = root / "sweep"
    assert (sweep / "trial-000" / "metrics.jsonl").read_bytes().startswith(first)  # kept (and later promoted): only appended to
    rows = [json.loads(line) for line in (sweep / "trial-001" / "metrics.jsonl").read_text().splitlines()]
    resumes = [r["from"] for r in rows if r.get("event") == "resume"]
    assert resumes and resumes[0] in ("step_0000002", "step_0000004")  # where it stood when the sweep was killed
    assert "sweep: resuming" in (sweep / "sweep.log").read_text()
    events = [(e["trial"], e["step"]) for e in map(json.loads, (sweep / "events.jsonl").read_text().splitlines())]
    assert len(events) == len(set(events)) and ("trial-000", 4) in events and ("trial-001", 4) in events
    for trial in ("trial-000", "trial-001", "trial-002", "trial-003"):
        steps = [r["step"] for r in map(json.loads, (sweep / trial / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
        assert steps == list(range(1, max(steps) + 1))  # a resumed run rewrites what came after its checkpoint


@pytest.fixture(scope="module")
def two_trials(corpus, tmp_path_factory):
    """A concurrent sweep of two trials (a learning rate and a depth), and each trial's config run alone."""
    root = tmp_path_factory.mktemp("pair")
    trials = [{"train.lr": 0.01}, {"train.lr": 0.003, "model.n_layer": 1}]
    cfg = base(corpus, 6, train={"eval_every": 3})

    def sweep_file(name: str, **options) -> Path:
        return write_sweep(root / f"{name}.yaml", {"dir": str(root / name), **options}, cfg, list=trials)

    path = sweep_file("concurrent", execution="concurrent", concurrency=2)
    code = main(["sweep", str(path), "--nproc", "1"])
    return sweep_file, root / "concurrent", code, {t: alone(root / "concurrent" / t, root / f"alone-{t}") for t in ("trial-000", "trial-001")}


def test_concurrent_trials_end_with_the_losses_they_have_alone(two_trials):
    _, sweep_dir, code, alone_curves = two_trials
    assert code == 0 and "2 trials, concurrent on local (2 at once, 1 process(es) each)" in (sweep_dir / "sweep.log").read_text()
    for trial, expected in alone_curves.items():
        assert curve(sweep_dir / trial) == expected
    assert curve(sweep_dir / "trial-000") != curve(sweep_dir / "trial-001")


@pytest.mark.slow  # a local Ray instance and its workers: ~20 s on a quiet 2-core machine (python -m pytest -m slow -k ray)
def test_ray_backend_runs_each_trial_as_a_ray_task(two_trials, capsys):
    pytest.importorskip("ray")
    sweep_file, _, _, alone_curves = two_trials
    path = sweep_file("ray", backend="ray", execution="concurrent", ray={"num_cpus": 2})
    assert main(["sweep", str(path), "--nproc", "1"]) == 0
    assert "2 trials, concurrent on ray (2 at once" in capsys.readouterr().out
    sweep_dir = Path(yaml.safe_load(path.read_text())["sweep"]["dir"])
    for trial, expected in alone_curves.items():
        assert curve(sweep_dir / trial) == expected
