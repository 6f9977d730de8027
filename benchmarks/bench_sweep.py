"""Sweep makespan: K small trials (different learning rates) run three ways on this machine.

    python benchmarks/bench_sweep.py [--trials 4] [--steps 40] [--concurrency 2] [--model gpt-tiny] [--budget-mb 0.4] [--quick] [--json FILE]

- `loop`: K `behemoth train` commands one after another (what a shell loop does: each pays its own interpreter start
  and imports);
- `sweep sequential`: `behemoth sweep` with one trial at a time (one slot process reused from trial to trial);
- `sweep concurrent`: `behemoth sweep` with `--concurrency` trials at once, each slot pinned to its share of the cores;
- `sweep hydra`: `behemoth sweep` with sweep.execution=hydra on `--concurrency` workers: every trial's shard tasks
  interleaved over the workers by longest remaining time, once with each trial whole (one shard) and once cut into
  shards against a device budget of `--budget-mb` (spilled to shared host memory between tasks, prefetched).

Every trial has 1 process and OMP_NUM_THREADS=1 in all three (so all three train the same numbers); the makespan is the
wall time of the whole command(s). The corpus is a few stdlib modules (tokenized once, before timing). The ratios are
the loop's makespan over each sweep's (above 1.0: the sweep finished sooner).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from ratios import add_report_args, command_line, ratio, write_rows

ROOT = Path(__file__).resolve().parent.parent


def base(corpus: Path, cache: Path, model: str, steps: int) -> dict:
    return {
        "model": {"preset": model},
        "train": {"steps": steps, "global_batch": 8, "seq_len": 32, "eval_every": steps, "eval_batches": 1, "warmup_steps": 2, "peak_tflops": 1},
        "checkpoint": {"every": 0, "export": False},
        "data": {"path": str(corpus), "cache_dir": str(cache)},
        "run": {"progress": False},
    }


def behemoth(*args: str) -> float:
    """Run a behemoth command to its end; its wall time."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "behemoth", *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"behemoth {' '.join(args[:2])} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return time.perf_counter() - t0


def lrs(k: int) -> list[float]:
    return [round(3e-3 * 1.5**i, 6) for i in range(k)]


def run_loop(work: Path, cfg: dict, k: int) -> float:
    config = work / "base.yaml"
    return sum(
        behemoth("train", "--nproc", "1", "--config", str(config), f"train.lr={lr}", f"run.dir={work}/loop-{i}") for i, lr in enumerate(lrs(k))
    )


def run_sweep(work: Path, cfg: dict, k: int, name: str, nproc: int = 1, **options: object) -> float:
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"sweep": {"dir": str(work / name), **options}, "base": cfg, "grid": {"train.lr": lrs(k)}}))
    return behemoth("sweep", str(path), "--nproc", str(nproc))


def hydra_shards(work: Path, name: str) -> tuple[int, float]:
    """Shards per trial and the largest resident bytes of model states (MiB) a hydra worker held, from hydra.json."""
    report = json.loads((work / name / "hydra.json").read_text())
    return max(t["shards"] for t in report["trials"].values()), max(report["resident_peak_bytes"]) / 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--budget-mb", type=float, default=0.4, help="hydra's device budget for model states per worker, MiB")
    add_report_args(p)
    args = p.parse_args(argv)
    steps = 10 if args.quick else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = work / "corpus.txt"
        corpus.write_text("".join((Path(json.__file__).parent / f).read_text() for f in ("decoder.py", "encoder.py", "scanner.py")) * 4)
        cfg = base(corpus, work / "cache", args.model, steps)
        (work / "base.yaml").write_text(yaml.safe_dump(cfg))
        behemoth("train", "--nproc", "1", "--config", str(work / "base.yaml"), "train.steps=1", f"run.dir={work}/warm")  # tokenize once
        loop = run_loop(work, cfg, args.trials)
        sequential = run_sweep(work, cfg, args.trials, "sequential")
        concurrent = run_sweep(work, cfg, args.trials, "concurrent", execution="concurrent", concurrency=args.concurrency)
        whole = run_sweep(work, cfg, args.trials, "hydra-whole", nproc=args.concurrency, execution="hydra")
        sharded = run_sweep(work, cfg, args.trials, "hydra", nproc=args.concurrency, execution="hydra", hydra={"budget_mb": args.budget_mb})
        whole_shards, whole_peak = hydra_shards(work, "hydra-whole")
        shards, peak = hydra_shards(work, "hydra")
    print(f"{command_line('bench_sweep.py', argv)}: {args.trials} trials of {args.model}, {steps} steps each, 1 process each, {os.cpu_count()} cores")
    print(f"{'case':<66} {'makespan s':>10} {'loop / this':>12} {'sequential / this':>18}")
    for case, seconds in (
        ("loop of behemoth train", loop),
        ("sweep sequential", sequential),
        (f"sweep concurrent ({args.concurrency} at once)", concurrent),
        (f"sweep hydra ({args.concurrency} workers, {whole_shards} shard a trial, {whole_peak:.2f} MiB)", whole),
        (f"sweep hydra ({args.concurrency} workers, {shards} shards a trial, peak {peak:.2f} of {args.budget_mb} MiB)", sharded),
    ):
        print(f"{case:<66} {seconds:>10.1f} {loop / seconds:>11.2f}x {sequential / seconds:>17.2f}x")
    rows = [
        ratio("sweep", f"{args.trials}x{args.model} hydra", "sweep sequential", "makespan_s", whole, sequential, higher_is_better=False),
        ratio("sweep", f"{args.trials}x{args.model} hydra sharded", "sweep sequential", "makespan_s", sharded, sequential, higher_is_better=False),
        ratio("sweep", f"{args.trials}x{args.model}", "loop of behemoth train", "makespan_s", sequential, loop, higher_is_better=False),
        ratio("sweep", f"{args.trials}x{args.model} concurrent", "loop of behemoth train", "makespan_s", concurrent, loop, higher_is_better=False),
    ]
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
