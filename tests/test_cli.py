"""The `behemoth` command: help, bad input refused before launch in one line, end-to-end runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from behemoth.cli import main
from tests.common import CACHE

TINY = [
    "model=gpt-tiny",
    "train.global_batch=8",
    "train.seq_len=32",
    "train.eval_every=4",
    "train.eval_batches=1",
    "train.peak_tflops=1",
    "run.progress=false",
    f"data.cache_dir={CACHE}",
]


def behemoth(*args: str, timeout: float = 240, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "behemoth", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def test_help_documents_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for key in [
        "--nproc",
        "--resume",
        "--config",
        "train.global_batch",
        "train.micro_batch",
        "data.path",
        "parallel.bucket_mb",
        "checkpoint.every",
        "model.n_layer",
        "gpt2-1.5b",
    ]:
        assert key in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["train.stpes=5"], "unknown option train.stpes; did you mean train.steps?"),
        (["train.steps=five"], "train.steps='five': Input should be a valid integer"),
        (["--nproc", "3", "train.global_batch=8"], "train.global_batch=8 does not divide over 3 data-parallel ranks"),
        (["--nproc", "2", "train.global_batch=8", "train.micro_batch=3"], "is not a multiple of train.micro_batch=3 x dp=2"),
        (["--nproc", "0"], "--nproc 0 is not a process count"),
        (["data.path=/no/such/corpus"], "data.path=/no/such/corpus does not exist"),
        (["--config", "/no/such.yaml"], "config file /no/such.yaml does not exist"),
        (["--resume", "/no/such/run"], "no checkpoint found at /no/such/run"),
    ],
)
def test_bad_input_is_one_line_before_launch(argv, message, capsys, tmp_path):
    assert main(["train", *argv, f"run.dir={tmp_path}/run", *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("behemoth: error:") and "\n" not in err


def test_empty_corpus_is_refused(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    assert main(["train", f"data.path={tmp_path / 'empty.txt'}", *TINY]) == 2
    assert "holds 0 tokens; give it some text" in capsys.readouterr().err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """`behemoth train --nproc 2` end to end: 8 steps of the tiny model."""
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    proc = behemoth("train", "--nproc", "2", "train.steps=8", "checkpoint.every=4", f"run.dir={run_dir}", *TINY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


def test_train_leaves_metrics_plot_checkpoint_and_weights(trained):
    run_dir, proc = trained
    assert "validation loss" in proc.stdout
    for name in ["config.yaml", "metrics.jsonl", "loss.png", "model.safetensors", "checkpoints/latest"]:
        assert (run_dir / name).exists(), name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] and r["grad_norm"] > 0 for r in steps)
    assert len(steps[-1]["memory_mb"]) == 2
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert vals[0] > vals[-1]


def test_saved_config_and_existing_run_dir(trained, capsys):
    run_dir, _ = trained
    assert main(["train", "--config", str(run_dir / "config.yaml")]) == 2
    assert "already holds checkpoints; pass --resume" in capsys.readouterr().err


def test_resume_on_four_processes_and_export(trained, tmp_path, capsys):
    run_dir, _ = trained
    assert main(["train", "--resume", str(run_dir), "train.steps=8"]) == 2
    assert "is at step 8 and train.steps=8" in capsys.readouterr().err
    proc = behemoth("train", "--nproc", "4", "--resume", str(run_dir), "train.steps=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 11))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_0000010"
    out = tmp_path / "w.safetensors"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0 and out.stat().st_size > 100_000


def test_torchrun_launches_workers(tmp_path):
    run_dir = tmp_path / "tr"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "behemoth",
        "train",
        "train.steps=2",
        f"run.dir={run_dir}",
        *TINY,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step_0000002").is_dir() and "behemoth: done" in proc.stdout


def test_a_dying_worker_stops_the_others_promptly(tmp_path):
    run_dir = tmp_path / "die"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "behemoth", "train", "--nproc", "2", "train.steps=100000", f"run.dir={run_dir}", *TINY],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        workers = _wait_for_workers(proc.pid, run_dir / "metrics.jsonl")
        os.kill(workers[-1], signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 2 and time.monotonic() - killed_at < 30
    assert "failed: killed by signal SIGKILL" in err


def _wait_for_workers(parent: int, metrics: Path, timeout: float = 120) -> list[int]:
    """The worker pids of a running `behemoth train`, once training has produced a metric."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().count("\n") >= 2:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
            workers = [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
            if len(workers) == 2:
                return sorted(workers)
        time.sleep(0.2)
    raise AssertionError("training never started")
