"""What a hydra trial leaves in its run directory besides metrics.jsonl, as its own `behemoth train` run leaves it:
train.log (the launch line, each segment's end or the error that ended it, with the worker's traceback), loss.png, and
(through MetricsLog) TensorBoard's event files."""

from __future__ import annotations

import contextlib
from pathlib import Path

from behemoth.errors import ERROR_PREFIX
from behemoth.metrics import plot_loss, read_metrics


def log_lines(run_dir: Path, *lines: str) -> None:
    """Append to the trial's train.log, where the other execution modes' trials print."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "train.log", "a") as f:
        f.write("".join(line.rstrip("\n") + "\n" for line in lines))


def plot(run_dir: Path) -> None:
    """loss.png from metrics.jsonl (nothing to plot: none)."""
    path = run_dir / "metrics.jsonl"
    if path.is_file() and read_metrics(path):
        plot_loss(path, run_dir / "loss.png")


def segment_done(run_dir: Path, busy_s: float) -> None:
    """The end of a segment: its validation curve so far in one line, and loss.png."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    curve = f"validation loss {val[0][1]:.3f} (step {val[0][0]}) -> {val[-1][1]:.3f} (step {val[-1][0]})" if val else ""
    log_lines(run_dir, f"behemoth: done: {curve} ({busy_s:.1f} s of shard tasks)")
    plot(run_dir)


def segment_failed(run_dir: Path, error: str, trace: str) -> None:
    """A segment that ended in an error: the worker's traceback (if it sent one), the error line, loss.png up to there."""
    log_lines(run_dir, *([trace] if trace else []), f"{ERROR_PREFIX}{error}")
    with contextlib.suppress(Exception):  # a plot that cannot be drawn must not hide the error
        plot(run_dir)
