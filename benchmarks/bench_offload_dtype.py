"""Disk offload with bf16 parameters against float32 ones: peak resident memory and step time of `behemoth train`.

    python benchmarks/bench_offload_dtype.py            # gpt2-124m, one sequence of 128 tokens, 5 steps each
    python benchmarks/bench_offload_dtype.py --quick    # gpt-tiny, a few seconds

Each run is `behemoth train --nproc 1 ... offload.params=disk offload.optimizer=disk parallel.param_dtype=D` in its own
process tree under /usr/bin/time -v (peak resident memory: its largest process); the step time is the median of the
steps after the first (metrics.jsonl). The float32 run is the peer: a ratio above 1 means bf16 did better.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ratios import add_report_args, ratio, write_rows

ROOT = Path(__file__).resolve().parents[1]


def run(dtype: str, model: list[str], steps: int, run_dir: Path) -> dict[str, float]:
    """One `behemoth train` run: its peak resident MiB and median step seconds."""
    args = [*model, f"train.steps={steps}", "train.global_batch=1", "train.micro_batch=1", "train.eval_every=0", "train.log_every=1"]
    args += ["offload.params=disk", "offload.optimizer=disk", f"parallel.param_dtype={dtype}", "checkpoint.every=0", "run.progress=false"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "behemoth", "train", "--nproc", "1", *args, f"run.dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"{dtype} run failed: {proc.stderr.strip().splitlines()[-1:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1)) / 1024
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r][1:]
    return {"peak_rss_mib": rss, "step_s": statistics.median(times), "loss": [r["loss"] for r in rows if "loss" in r][-1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_report_args(p)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args(argv)
    model = ["model=gpt-tiny", "train.seq_len=32"] if a.quick else ["model=gpt2-124m", f"train.seq_len={a.seq}"]
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("fp32", "bf16"):
            got[dtype] = run(dtype, model, 3 if a.quick else a.steps, Path(tmp) / dtype)
    print(f"disk offload, {' '.join(model)}, 1 process, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    print("| param_dtype | peak RSS MiB | step s (median) | last loss |\n|---|---|---|---|")
    for dtype, r in got.items():
        print(f"| {dtype} | {r['peak_rss_mib']:.0f} | {r['step_s']:.3f} | {r['loss']:.4f} |")
    rows = [
        ratio(
            "offload-dtype", model[0], "offload fp32", "peak RSS", got["bf16"]["peak_rss_mib"], got["fp32"]["peak_rss_mib"], higher_is_better=False
        ),
        ratio("offload-dtype", model[0], "offload fp32", "step time", got["bf16"]["step_s"], got["fp32"]["step_s"], higher_is_better=False),
    ]
    for r in rows:
        print(f"bf16 vs fp32 {r['metric']}: ratio {r['ratio']:.2f} (above 1: bf16 better)")
    write_rows(a.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
