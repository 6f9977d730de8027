"""The sweep's result: one row per trial (its options, best validation loss, tokens, time, status) as a printed table,
CSV and Markdown, and every trial's validation curve in one PNG."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from behemoth.sweep.setup import SweepSetup

COLUMNS = ("trial", "config", "best_val_loss", "best_step", "steps", "tokens", "wall_s", "status")


def read_curve(run_dir: Path) -> tuple[list[tuple[int, float]], int]:
    """A trial's validation curve (step, loss) and the last step it trained, from its metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    val: dict[int, float] = {}
    trained = 0
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "val_loss" in record:
                val[record["step"]] = float(record["val_loss"])
            if "loss" in record:
                trained = max(trained, record["step"])
    return sorted(val.items()), trained


def leaderboard_rows(setup: SweepSetup, status: dict[str, str], wall: dict[str, float], errors: dict[str, str]) -> list[dict[str, Any]]:
    """Rows best first (lowest best validation loss; failed and unstarted trials last)."""
    rows = []
    for trial in setup.trials:
        curve, trained = read_curve(setup.trial_dir(trial.name))
        finite = [(loss, step) for step, loss in curve if step > 0 and math.isfinite(loss)]
        best, best_step = min(finite) if finite else (math.inf, 0)
        state = status[trial.name]
        if state == "stopped":
            state = f"stopped at {trained}"
        elif state == "failed":
            state = f"failed: {errors.get(trial.name, '')}"
        rows.append(
            {
                "trial": trial.name,
                "config": trial.diff(),
                "best_val_loss": best,
                "best_step": best_step,
                "steps": trained,
                "tokens": trained * setup.tokens_per_step[trial.name],
                "wall_s": round(wall.get(trial.name, 0.0), 2),
                "status": state,
            }
        )
    return sorted(rows, key=lambda r: (r["best_val_loss"], r["trial"]))


def print_table(rows: list[dict[str, Any]], say: Callable[[str], None]) -> None:
    for line in markdown(rows).splitlines():
        say(line)


def markdown(rows: list[dict[str, Any]]) -> str:
    cells = [[cell(r[c], c) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(COLUMNS)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)) + " |", "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |" for row in cells]
    return "\n".join(lines) + "\n"


def cell(value: Any, column: str) -> str:
    if isinstance(value, float):
        return "-" if math.isinf(value) else f"{value:.1f}" if column == "wall_s" else f"{value:.4f}"
    return str(value).replace("|", "/")


def write_leaderboard(rows: list[dict[str, Any]], setup: SweepSetup, *, plot: bool) -> None:
    with open(setup.dir / "leaderboard.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({**r, "best_val_loss": "" if math.isinf(r["best_val_loss"]) else r["best_val_loss"]} for r in rows)
    (setup.dir / "leaderboard.md").write_text(markdown(rows))
    if plot:
        plot_curves(setup, setup.dir / "curves.png")


def plot_curves(setup: SweepSetup, out: Path) -> None:
    """Every trial's validation loss against step, one line each, labelled with the options it sets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    for trial in setup.trials:
        curve, _ = read_curve(setup.trial_dir(trial.name))
        curve = [(s, v) for s, v in curve if math.isfinite(v)]
        if curve:
            ax.plot(*zip(*curve), "o-", ms=3, lw=1.2, label=f"{trial.name} {trial.diff()}"[:60])
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(f"sweep {setup.dir.name}: {len(setup.trials)} trials")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
