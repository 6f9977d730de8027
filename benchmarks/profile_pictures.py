"""The pictures of docs/profiling.md, drawn from what behemoth writes: a run's TensorBoard event files and a profile's
Chrome traces.

    python benchmarks/profile_pictures.py [--out docs/images]

(1) `behemoth train` a small GPT for 60 steps with TensorBoard on, read its event files back with TensorBoard's own
`EventAccumulator`, and draw every scalar chart as TensorBoard's scalars page lays them out (raw points faint, the
default 0.6 exponential smoothing drawn over them) -> tensorboard-scalars.png. (2) `behemoth profile --trace` a 2-stage
1F1B pipeline on 2 processes and draw behemoth's spans of both ranks on one clock (each rank's trace is shifted by the
wall-clock time of the barrier it stored beside the trace), nested spans below their parents -> trace-pp2.png.

There is no browser on the machine these pictures were made on, so they are drawn with matplotlib from the files the
browser tools (TensorBoard, Perfetto) would open; the scalars and spans are the files' own, not re-measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["model=gpt-1m", "train.global_batch=8", "train.seq_len=64", "train.micro_batch=2"]
SMOOTHING = 0.6  # TensorBoard's default
COLOURS = {"FORWARD": "#4c72b0", "BACKWARD": "#dd8452", "WEIGHT": "#c44e52", "wait": "#8c8c8c", "optimizer": "#55a868", "on ": "#937860"}


def behemoth(*args: str, cwd: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "behemoth", *args], cwd=cwd, env=env, check=True)


def smoothed(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """TensorBoard's debiased exponential moving average."""
    out, last, num = [], 0.0, 0
    for v in values:
        num += 1
        last = last * weight + (1 - weight) * v
        out.append(last / (1 - weight**num))
    return out


def scalars_picture(run_dir: Path, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    tags = [t for t in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s") if t in acc.Tags()["scalars"]]
    cols = 4
    rows = -(-len(tags) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, tag in zip(axes.flat, tags):
        events = acc.Scalars(tag)
        steps, values = [e.step for e in events], [e.value for e in events]
        ax.plot(steps, values, color="#ff7043", alpha=0.25, linewidth=1)
        ax.plot(steps, smoothed(values), color="#ff7043", linewidth=1.6)
        ax.set_title(tag, fontsize=10, loc="left")
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
    for ax in list(axes.flat)[len(tags) :]:
        ax.axis("off")
    fig.suptitle(f"TensorBoard scalars of {run_dir.name} (read from its event files; smoothing {SMOOTHING})", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return tags


def spans_of(trace_file: Path) -> tuple[int, list[tuple[str, float, float]]]:
    """(rank, [(name, start s on the shared clock, duration s)]) of behemoth's spans in one rank's trace."""
    trace = json.loads(trace_file.read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and str(e.get("name", "")).startswith("behemoth/")]
    first = min(e["ts"] for e in events)
    clock = trace["behemoth_clock"]["unix_time_at_barrier"]
    return trace["behemoth_clock"]["rank"], [(e["name"][9:], clock + (e["ts"] - first) / 1e6, e["dur"] / 1e6) for e in events]


def colour(name: str) -> str:
    return next((c for key, c in COLOURS.items() if key in name), "#b0b0b0")


def trace_picture(trace_dir: Path, out: Path) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted(spans_of(f) for f in trace_dir.glob("rank*.pt.trace.json"))
    origin = min(s for _, spans in ranks for _, s, _ in spans)
    fig, ax = plt.subplots(figsize=(15, 1.2 + 1.6 * len(ranks)))
    count = 0
    for lane, (_, spans) in enumerate(ranks):
        open_until: list[float] = []  # end time of the span open at each depth
        for name, start, dur in sorted(spans, key=lambda x: (x[1], -x[2])):
            while open_until and open_until[-1] <= start + 1e-9:
                open_until.pop()
            depth = len(open_until)
            open_until.append(start + dur)
            y = lane * 6 + depth
            ax.broken_barh([((start - origin) * 1e3, dur * 1e3)], (y, 0.9), facecolors=colour(name), edgecolor="white", linewidth=0.3)
            if dur * 1e3 > 25 and depth >= 1:
                ax.text((start - origin + dur / 2) * 1e3, y + 0.45, name.replace("pp/", ""), ha="center", va="center", fontsize=5.5)
            count += 1
    ax.set_yticks([lane * 6 + 2 for lane in range(len(ranks))], [f"rank {r}" for r, _ in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first span (both ranks on one clock)")
    ax.set_title("behemoth profile --trace, 2-stage 1F1B pipeline: behemoth's spans per rank, nested spans below their parents", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, ["forward", "backward", "weight grad", "wait", "optimizer", "collective issued"], fontsize=7, ncol=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return count


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "docs" / "images"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="behemoth-pictures-") as tmp:
        work = Path(tmp)
        run = work / "run-gpt-1m"
        steps = ["train.steps=60", "train.eval_every=10", "train.log_every=2"]
        behemoth("train", "--nproc", "1", *MODEL, *steps, f"run.dir={run}", "run.tensorboard=true", cwd=work)
        tags = scalars_picture(run, out / "tensorboard-scalars.png")
        print(f"{out / 'tensorboard-scalars.png'}: {len(tags)} charts ({', '.join(tags)})")
        trace = work / "trace"
        behemoth("profile", "--nproc", "2", "--steps", "2", "--runs", "synthetic", "--trace", str(trace), "parallel.pp=2", *MODEL, cwd=work)
        spans = trace_picture(trace, out / "trace-pp2.png")
        print(f"{out / 'trace-pp2.png'}: {spans} spans of {len(list(trace.glob('rank*.json')))} ranks")


if __name__ == "__main__":
    main()
