"""Sweep makespan: K small trials (different learning rates) run several ways on this machine; and K trials larger than
a device budget, hydra against each trial alone with offload.

    python benchmarks/bench_sweep.py [--part makespan|spill|all] [--trials 4] [--steps 40] [--concurrency 2] [--model gpt-tiny]
        [--budget-mb 0.4] [--cases loop,sequential,concurrent,hydra-whole,hydra,deepspeed-0,deepspeed-1,deepspeed-2] [--ds-nproc 2]
        [--spill-model gpt-1m] [--spill-layers 8]
        [--spill-budget-mb 6.5]
        [--quick] [--json FILE]

`--part makespan`:
- `loop`: K `behemoth train` commands one after another (what a shell loop does: each pays its own interpreter start
  and imports);
- `sweep sequential`: `behemoth sweep` with one trial at a time (one slot process reused from trial to trial);
- `sweep concurrent`: `behemoth sweep` with `--concurrency` trials at once, each slot pinned to its share of the cores;
- `sweep hydra`: `behemoth sweep` with sweep.execution=hydra on `--concurrency` workers: every trial's shard tasks
  interleaved over the workers by longest remaining time, once with each trial whole (one shard) and once cut into
  shards against a device budget of `--budget-mb` (spilled to shared host memory between tasks, prefetched);
- `deepspeed-Z` (needs the `bench` extra): the same K trials one after another under DeepSpeed ZeRO stage Z, each over
  `--ds-nproc` gloo ranks on DeepSpeed's CPU accelerator, in one torchrun launch (benchmarks/sweep_deepspeed.py: the
  sweep's model, data, schedule and AdamW); with `sequential` also run, each trial's losses are compared with its own.

`--part spill`: K trials of `--spill-model` (states over `--spill-budget-mb`) on 2 ranks: hydra (budget, shards spilled
to host memory) against a sequential sweep of `--nproc 2` runs with offload.params=host and offload.optimizer=host.

Every trial has OMP_NUM_THREADS=1 (so all cases train the same numbers); the makespan is the wall time of the whole
command(s), CPU s the user + system time of the command and every process it waited for. The corpus is a few stdlib
modules (tokenized once, before timing). sequential / this above 1.0: the case finished sooner than sequential.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
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


CPU_S: list[float] = []  # the CPU seconds (user + system, the command and every process it waited for) of each behemoth()


def behemoth(*args: str) -> float:
    """Run a behemoth command to its end; its wall time (its CPU time appended to CPU_S)."""
    return timed_command("-m", "behemoth", *args)


def timed_command(*args: str, timeout: float | None = None) -> float:
    """Run `python ARGS` to its end (OMP_NUM_THREADS=1, this tree importable); its wall time (its CPU time, and that of
    every process it waited for, appended to CPU_S)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args[:3])} failed: {proc.stderr.strip().splitlines()[-1:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU_S.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
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


DEEPSPEED = ROOT / "benchmarks" / "sweep_deepspeed.py"


def run_deepspeed(work: Path, k: int, stage: int, nproc: int, config: str = "base.yaml") -> float:
    """The K trials one after another under DeepSpeed ZeRO `stage`, each over `nproc` gloo ranks: one torchrun launch
    of benchmarks/sweep_deepspeed.py (the same model, data, schedule and AdamW as the sweep's trials)."""
    argv = ["--config", str(work / config), "--lrs", ",".join(map(str, lrs(k))), "--stage", str(stage)]
    argv += ["--out", str(work / f"deepspeed-{stage}.json")]
    return timed_command("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(DEEPSPEED), *argv, timeout=3600)


def trial_curves(folder: Path, k: int) -> list[tuple[list[float], float]]:
    """Each trial of a sweep directory, in grid order: its per-step training losses and its last validation loss."""
    curves = []
    for i in range(k):
        rows = [json.loads(line) for line in (folder / f"trial-{i:03d}" / "metrics.jsonl").read_text().splitlines()]
        curves.append(([r["loss"] for r in rows if "loss" in r], [r["val_loss"] for r in rows if "val_loss" in r][-1]))
    return curves


def deepspeed_agreement(work: Path, k: int, stage: int) -> str:
    """How far DeepSpeed's per-step and final validation losses are from the sequential sweep's, over the K trials."""
    ours = trial_curves(work / "sequential", k)
    theirs = json.loads((work / f"deepspeed-{stage}.json").read_text())["trials"]
    steps = max(abs(a - b) / abs(a) for (losses, _), t in zip(ours, theirs) for a, b in zip(losses, t["losses"], strict=True))
    val = max(abs(v - t["val_loss"]) / abs(v) for (_, v), t in zip(ours, theirs))
    finals = ", ".join(f"{v:.4f}/{t['val_loss']:.4f}" for (_, v), t in zip(ours, theirs))
    return f"  deepspeed-{stage} vs sweep sequential: largest relative loss difference {steps:.1e} (steps), {val:.1e} (final val; {finals})"


def hydra_shards(work: Path, name: str) -> tuple[int, float]:
    """Shards per trial and the largest resident bytes of model states (MiB) a hydra worker held, from hydra.json."""
    report = json.loads((work / name / "hydra.json").read_text())
    return max(t["shards"] for t in report["trials"].values()), max(report["resident_peak_bytes"]) / 2**20


def breakdown(work: Path, name: str) -> str:
    """Where a hydra sweep's time went, from its hydra.json."""
    r = json.loads((work / name / "hydra.json").read_text())
    joined = sum(t.get("joined_tasks", 0) for t in r["trials"].values())
    return (
        f"  {name}: {r.get('tasks', '?')} tasks ({joined} joined), workers' start-up {max(r.get('startup_s', [0])):.1f} s, "
        f"busy {sum(r['busy_s']):.1f} s, copy-in {sum(r.get('load_s', [0])):.1f} s (worker-seconds, of {r['workers']} x {r['wall_s']:.1f} s)"
    )


def makespan_part(args: argparse.Namespace, work: Path, steps: int, argv: list[str] | None) -> list[dict]:
    """The makespan table: the cases asked for (loop, sequential, concurrent, hydra whole, hydra sharded)."""
    cfg = base(work / "corpus.txt", work / "cache", args.model, steps)
    (work / "base.yaml").write_text(yaml.safe_dump(cfg))
    k, c = args.trials, args.concurrency
    runs = {
        "loop": lambda: run_loop(work, cfg, k),
        "sequential": lambda: run_sweep(work, cfg, k, "sequential"),
        "concurrent": lambda: run_sweep(work, cfg, k, "concurrent", execution="concurrent", concurrency=c),
        "hydra-whole": lambda: run_sweep(work, cfg, k, "hydra-whole", nproc=c, execution="hydra"),
        "hydra": lambda: run_sweep(work, cfg, k, "hydra", nproc=c, execution="hydra", hydra={"budget_mb": args.budget_mb}),
    }
    runs |= {f"deepspeed-{z}": lambda z=z: run_deepspeed(work, k, z, args.ds_nproc) for z in range(4)}
    cases = args.cases.split(",")
    if any(case.startswith("deepspeed") for case in cases):  # its first launch JIT-builds a CPU op (minutes): not timed
        run_deepspeed(work, 1, 0, args.ds_nproc, config="warm.yaml")
    measured: dict[str, tuple[float, float]] = {}
    for case in cases:
        if case not in runs:
            raise SystemExit(f"--cases: {case!r} is not one of {','.join(runs)}")
        CPU_S.clear()
        wall = runs[case]()
        measured[case] = (wall, sum(CPU_S))
    labels = {"loop": "loop of behemoth train", "sequential": "sweep sequential", "concurrent": f"sweep concurrent ({c} at once)"}
    labels |= {f"deepspeed-{z}": f"DeepSpeed ZeRO-{z}, trials one after another ({args.ds_nproc} ranks each)" for z in range(4)}
    for name in ("hydra-whole", "hydra"):
        if name in measured:
            shards, peak = hydra_shards(work, name)
            labels[name] = f"sweep hydra ({c} workers, {shards} shard(s) a trial, peak {peak:.2f} MiB" + (
                f" of {args.budget_mb})" if name == "hydra" else ")"
            )
    print(f"{command_line('bench_sweep.py', argv)}: {k} trials of {args.model}, {steps} steps each, {os.cpu_count()} cores, load {load()}")
    seq = measured.get("sequential", (math.nan, math.nan))[0]
    print(f"{'case':<72} {'makespan s':>10} {'CPU s':>8} {'sequential / this':>18}")
    for case, (wall, cpu) in measured.items():
        print(f"{labels[case]:<72} {wall:>10.1f} {cpu:>8.1f} {seq / wall:>17.2f}x")
    for name in ("hydra-whole", "hydra"):
        if name in measured:
            print(breakdown(work, name))
    for z in range(4):
        if f"deepspeed-{z}" in measured and "sequential" in measured:
            print(deepspeed_agreement(work, k, z))
    rows = []
    for case in ("hydra-whole", "hydra", "concurrent", *(f"deepspeed-{z}" for z in range(4))):
        if case in measured and "sequential" in measured:
            rows.append(ratio("sweep", f"{k}x{args.model} {case}", "sweep sequential", "makespan_s", measured[case][0], seq, higher_is_better=False))
    return rows


def spill_part(args: argparse.Namespace, work: Path, steps: int, argv: list[str] | None) -> list[dict]:
    """K trials whose model states are over the device budget, on 2 ranks: hydra (shards spilled to host memory between
    tasks) against a sequential sweep of the same trials each trained alone with parameters, gradients and optimizer
    states offloaded to host memory (offload.params/optimizer=host) over the same ranks."""
    cfg = base(work / "corpus.txt", work / "cache", args.spill_model, steps)
    cfg["model"]["n_layer"] = args.spill_layers
    k, budget = args.trials, args.spill_budget_mb
    offloaded = {**cfg, "offload": {"params": "host", "optimizer": "host"}}
    CPU_S.clear()
    hydra = run_sweep(work, cfg, k, "spill-hydra", nproc=2, execution="hydra", hydra={"budget_mb": budget, "spill": "host"})
    hydra_cpu = sum(CPU_S)
    CPU_S.clear()
    offload = run_sweep(work, offloaded, k, "spill-offload", nproc=2)
    offload_cpu = sum(CPU_S)
    report = json.loads((work / "spill-hydra" / "hydra.json").read_text())
    states = max(t["state_bytes"] for t in report["trials"].values()) / 2**20
    shards, peak = hydra_shards(work, "spill-hydra")
    tokens = k * steps * cfg["train"]["global_batch"] * cfg["train"]["seq_len"]
    print(
        f"{command_line('bench_sweep.py', argv)}: {k} trials of {args.spill_model} ({states:.2f} MiB of model states each, "
        f"{states / budget:.1f}x the {budget} MiB budget), {steps} steps each, 2 ranks, {os.cpu_count()} cores, load {load()}"
    )
    print(f"{'case':<72} {'makespan s':>10} {'CPU s':>8} {'tokens/s':>9} {'hydra / this':>13}")
    for label, wall, cpu in (
        (f"sweep hydra (2 workers, {shards} shards a trial, peak {peak:.2f} of {budget} MiB)", hydra, hydra_cpu),
        ("sweep sequential, each trial offloaded to host (--nproc 2)", offload, offload_cpu),
    ):
        print(f"{label:<72} {wall:>10.1f} {cpu:>8.1f} {tokens / wall:>9.0f} {(tokens / hydra) / (tokens / wall):>12.2f}x")
    print(breakdown(work, "spill-hydra"))
    return [ratio("sweep", f"{k}x{args.spill_model} over budget hydra", "sequential with offload", "tokens_per_s", tokens / hydra, tokens / offload)]


def load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["makespan", "spill", "all"], default="makespan")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--model", default="gpt-tiny")
    p.add_argument("--budget-mb", type=float, default=0.4, help="hydra's device budget for model states per worker, MiB")
    p.add_argument("--cases", default="loop,sequential,concurrent,hydra-whole,hydra", help="makespan cases to run, comma-separated")
    p.add_argument("--ds-nproc", type=int, default=2, help="deepspeed-Z cases: ranks per trial (DeepSpeed's data parallelism)")
    p.add_argument("--spill-model", default="gpt-1m", help="--part spill: the model whose states exceed --spill-budget-mb")
    p.add_argument("--spill-layers", type=int, default=8, help="--part spill: the model's blocks")
    p.add_argument("--spill-budget-mb", type=float, default=6.5, help="--part spill: hydra's device budget per worker, MiB")
    add_report_args(p)
    args = p.parse_args(argv)
    steps = 10 if args.quick else args.steps
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = work / "corpus.txt"
        corpus.write_text("".join((Path(json.__file__).parent / f).read_text() for f in ("decoder.py", "encoder.py", "scanner.py")) * 4)
        for model in {args.model, args.spill_model}:  # tokenize once, before timing
            (work / "warm.yaml").write_text(yaml.safe_dump(base(corpus, work / "cache", model, 1)))
            behemoth("train", "--nproc", "1", "--config", str(work / "warm.yaml"), f"run.dir={work}/warm-{model}")
        if args.part in ("makespan", "all"):
            rows += makespan_part(args, work, steps, argv)
        if args.part in ("spill", "all"):
            rows += spill_part(args, work, steps, argv)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
