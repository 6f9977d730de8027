"""A streamed pipeline (offload under pp=2) against the same pipeline in memory: step time, peak RSS and bytes moved per rank.

Same GPT, schedule, micro-batching and AdamW on both sides (bench_pipeline.py's harness: `timed_steps`, fresh processes
per run, rounds interleaved); only where each stage's units live differs: in memory, or on disk (parameters, gradients
and Adam's moments; offload/stage_stream.py streams each stage's units pass by pass). Per rank: the fastest step's wall
time, the median step's CPU seconds (what a loaded machine disturbs least), the process's peak resident memory
(VmHWM) and the bytes its tiers read and wrote in the last step (with the bytes its unit visits plan). Run:

    python benchmarks/bench_offload_pipeline.py [--steps 3] [--warmup 1] [--rounds 2] [--schedule 1f1b] [--readme]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_pipeline import data, timed_steps, write_readme  # noqa: E402

MODEL = [
    "model=gpt-1m",
    "model.n_layer=8",
    "model.d_model=512",
    "model.n_head=8",
    "model.context=128",
    "train.seq_len=128",
    "train.global_batch=8",
    "parallel.pp=2",
    "parallel.microbatches=4",
    "run.progress=false",
    "run.timeout_s=600",
]
PLACEMENTS = {"in memory": [], "offload disk": ["offload.params=disk", "offload.optimizer=disk"]}
BEGIN, END = "<!-- bench_offload_pipeline: begin -->", "<!-- bench_offload_pipeline: end -->"


def peak_rss_mib() -> float:
    text = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in text.splitlines() if line.startswith("VmHWM:"))) / 1024


def rank_body(placement: str, run_dir: str, steps: int, warmup: int, schedule: str = "1f1b") -> dict[str, Any]:
    """One rank of the pipeline: its step times, CPU seconds, peak RSS and the last step's bytes moved (and planned)."""
    from behemoth.config import load_config
    from behemoth.engine import build_engine
    from behemoth.topology import init_runtime

    cfg = load_config(None, [*MODEL, f"parallel.schedule={schedule}", *PLACEMENTS[placement], f"run.dir={run_dir}"])
    rt = init_runtime(**cfg.parallel.degrees())
    engine, sampler = build_engine(cfg, rt), data(cfg)
    moved: list[tuple[int, int]] = []

    def after_step() -> None:
        syncs = [s for s in engine.model.syncs if hasattr(s, "step_bytes")]
        counted = syncs[0].step_bytes() if syncs else {}
        moved.append((sum(r for r, _ in counted.values()), sum(w for _, w in counted.values())))

    times, cpu = timed_steps(engine.train_step, sampler, steps, warmup, after_step)
    params = sum(p.numel() for p in engine.model.module.parameters())
    engine.close()
    rt.close()
    return {"step_s": min(times), "cpu_s": cpu, "rss_mib": peak_rss_mib(), "moved": moved[-1], "local_params": params}


def run(steps: int, warmup: int, rounds: int, schedule: str = "1f1b") -> dict[str, dict[str, Any]]:
    """Each placement `rounds` times, interleaved; the fastest step and the least CPU work kept, RSS and bytes per rank."""
    from behemoth.faults.ranks import run_ranks

    best: dict[str, dict[str, Any]] = {}
    for round_ in range(rounds):
        for placement in PLACEMENTS:
            with tempfile.TemporaryDirectory() as run_dir:
                ranks = run_ranks(2, rank_body, placement, run_dir, steps, warmup, schedule, timeout=1800)
            got = {
                "step_s": max(r["step_s"] for r in ranks),  # a pipelined step ends when its slowest rank does
                "cpu_s": sum(r["cpu_s"] for r in ranks),
                "rss_mib": [r["rss_mib"] for r in ranks],
                "moved": [r["moved"] for r in ranks],
            }
            old = best.get(placement)
            if old is None or got["step_s"] < old["step_s"]:
                best[placement] = got | ({"cpu_s": min(got["cpu_s"], old["cpu_s"])} if old else {})
            elif old is not None:
                old["cpu_s"] = min(old["cpu_s"], got["cpu_s"])
            print(f"  round {round_ + 1}: {placement}: {got['step_s']:.2f} s/step", file=sys.stderr, flush=True)
    return best


def format_table(best: dict[str, dict[str, Any]], command: str, load: tuple[float, float, float], schedule: str = "1f1b") -> str:
    mib = 2**20
    base = best["in memory"]
    lines = [
        f"`{command}` — GPT with 8 blocks, d_model 512, 8 heads, 128 tokens, 8 sequences per step in 4 micro-batches, "
        f"pp=2 {schedule}, float32 AdamW, one thread per process, 2 processes; load average before the run "
        f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on 2 shared cores (wall times are noisy; CPU seconds less so).",
        "",
        "| placement | step s (fastest) | vs in memory | CPU s/step, both ranks | peak RSS MiB, rank 0 / rank 1 "
        "| read / written MiB per step, rank 0 | rank 1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for placement, r in best.items():
        moved = [f"{rd / mib:.1f} / {wr / mib:.1f}" if rd or wr else "—" for rd, wr in r["moved"]]
        lines.append(
            f"| {placement} | {r['step_s']:.2f} | {r['step_s'] / base['step_s']:.2f}x | {r['cpu_s']:.2f} "
            f"| {r['rss_mib'][0]:.0f} / {r['rss_mib'][1]:.0f} | {moved[0]} | {moved[1]} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each placement, interleaved; the fastest is kept")
    parser.add_argument("--readme", action="store_true", help="write the table into benchmarks/README.md")
    parser.add_argument("--schedule", default="1f1b", help="the pipeline schedule of both sides (zb-h1, zbv, ... stream too)")
    from ratios import add_report_args, command_line, ratio, write_rows

    add_report_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds = 2, 1, 1
    load = os.getloadavg()
    best = run(args.steps, args.warmup, args.rounds, args.schedule)
    text = format_table(best, command_line("bench_offload_pipeline.py", argv).strip(), load, args.schedule)
    print(text)
    mem, disk = best["in memory"], best["offload disk"]
    case = ("offload-pipeline", f"pp=2 {args.schedule}", "in memory")
    rows = [
        ratio(*case, "peak RSS, largest rank", max(disk["rss_mib"]), max(mem["rss_mib"]), higher_is_better=False),
        ratio(*case, "step time", disk["step_s"], mem["step_s"], higher_is_better=False),
    ]
    write_rows(args.json, rows)
    if args.readme:
        write_readme(text, (BEGIN, END), "Offload under a pipeline (bench_offload_pipeline.py)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
