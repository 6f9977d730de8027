"""Pictures of a schedule: the rank x time grid as text, and a Gantt chart PNG of a simulated step."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from behemoth.parallel.pipeline.analysis.simulate import SimResult, run_timeline
from behemoth.parallel.pipeline.schedules import COMPUTE, Action, Kind, Schedule

COLORS = {
    Kind.FORWARD: "#4C72B0",
    Kind.BACKWARD: "#DD8452",
    Kind.BACKWARD_INPUT: "#C44E52",
    Kind.BACKWARD_WEIGHT: "#55A868",
    Kind.GRAD_SYNC: "#8172B3",
    Kind.RECOMPUTE: "#937860",
}
NAMES = {
    Kind.FORWARD: "forward",
    Kind.BACKWARD: "backward",
    Kind.BACKWARD_INPUT: "input grad (B)",
    Kind.BACKWARD_WEIGHT: "weight grad (W)",
    Kind.GRAD_SYNC: "grad sync",
    Kind.RECOMPUTE: "recompute (R)",
}


def cell_label(schedule: Schedule, action: Action) -> str:
    """`F3`, `B3`, `W3`; with several chunks per rank the stage goes in front (`5F3`), as PyTorch prints it."""
    return (str(action.stage) if schedule.chunks > 1 else "") + action.label


def format_grid(schedule: Schedule) -> str:
    """The rank x time grid in unit slots (every compute pass one column, zero p2p), `.` where a rank idles."""
    timeline = run_timeline(schedule)
    slots = int(max((row[-1].end for row in timeline if row), default=0))
    rows = []
    for row in timeline:
        cells = ["."] * slots
        for interval in row:
            if interval.action.kind in COMPUTE:
                cells[int(interval.start)] = cell_label(schedule, interval.action)
        rows.append(cells)
    width = max([len(c) for cells in rows for c in cells] + [len(str(slots - 1))])
    header = f"{'slot':<7}|" + "".join(f" {t:>{width}}" for t in range(slots))
    lines = [f"{schedule.name}: p={schedule.ranks} m={schedule.microbatches} v={schedule.chunks}", header]
    lines += [f"rank {r:<2}|" + "".join(f" {c:>{width}}" for c in cells) for r, cells in enumerate(rows)]
    return "\n".join(lines)


def _draw_lanes(ax, result: SimResult, schedule: Schedule) -> None:  # noqa: ANN001 (a matplotlib Axes)
    """One lane per rank (rank 0 on top), a box per compute pass or sync with its micro-batch number."""
    for rank, row in enumerate(result.timeline):
        for iv in row:
            kind = iv.action.kind
            if kind not in COLORS or iv.end <= iv.start:
                continue
            alpha = 1.0 if iv.action.chunk == 0 or kind is Kind.GRAD_SYNC else 0.6
            ax.broken_barh([(iv.start, iv.end - iv.start)], (rank - 0.4, 0.8), facecolors=COLORS[kind], edgecolor="white", linewidth=0.6, alpha=alpha)
            text = "S" if kind is Kind.GRAD_SYNC else str(iv.action.microbatch)
            ax.text((iv.start + iv.end) / 2, rank, text, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(schedule.ranks), [f"rank {r}" for r in range(schedule.ranks)])
    ax.set_ylim(schedule.ranks - 0.5, -0.5)
    ax.set_xlim(0, result.step_time)
    ax.set_title(
        f"{schedule.name}: p={schedule.ranks}, m={schedule.microbatches}, v={schedule.chunks}   "
        f"step {result.step_time:.4g}, bubble {result.bubble_fraction:.1%}",
        fontsize=9,
        loc="left",
    )


def draw_gantt(runs: Sequence[tuple[Schedule, SimResult]], path: str | Path, *, time_unit: str = "ms") -> Path:
    """Write a Gantt chart PNG with one panel per (schedule, simulated result), colored by pass kind."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    lanes = sum(schedule.ranks for schedule, _ in runs)
    fig = Figure(figsize=(12, 1.0 + 0.32 * lanes + 0.55 * len(runs)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, (schedule, result) in zip(axes, runs):
        _draw_lanes(ax, result, schedule)
    axes[-1].set_xlabel(f"time ({time_unit}); lighter boxes: a rank's second or later model chunk")
    kinds = sorted({iv.action.kind for _, r in runs for row in r.timeline for iv in row if iv.action.kind in COLORS}, key=list(COLORS).index)
    fig.legend(handles=[Patch(color=COLORS[k], label=NAMES[k]) for k in kinds], loc="outside upper right", ncols=len(kinds), fontsize=8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
