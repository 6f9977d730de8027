"""Burst parallelism (DeepPool) against data parallelism: simulated clusters, measured CPU ranks, multiplexing.

    python benchmarks/bench_burst.py [--part simulate|measure|trainer|multiplex|all] [--nproc 2] [--quick] [--json FILE]

- `simulate`: the planner's cost model over cluster presets (A100 and H100 servers, InfiniBand between them) at
  strong-scaling points too large for this machine (1 or 2 sequences per device): data parallelism's step, the burst
  plan's (amplification cap 2x), the device time each leaves idle, and the cluster throughput normalized to data
  parallelism alone when a background job of the same model (8 sequences per device) keeps 50% of its solo rate in
  that idle time (for data parallelism too: `DP + bg`, the fair comparison).
- `measure`: `--nproc` CPU ranks at one sequence per rank: the burst plan the planner makes for this machine (its
  cached calibration) executed by behemoth/parallel/burst, against the same runtime with every layer on every rank
  (data parallelism); measured and predicted step times.
- `trainer`: a plan through `behemoth train`'s Trainer (parallel.burst: AdamW, global-norm clipping, metrics) against
  the trainer's plain data parallelism on the same world and batch: median step time, CPU seconds of all ranks per
  step, tokens/s, measured / predicted, and each rank's parameter + AdamW bytes. The plan: `--widths`, else the
  planner's, else (it keeps every layer on every rank) the blocks on half the ranks (`middle_plan`).
- `multiplex`: the burst foreground alone, a background training job alone (1 process, nice 19), then both at once:
  the foreground's slowdown and the share of its solo throughput the background keeps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ratios import add_report_args, best_of_rounds, command_line, ratio, write_rows  # noqa: E402

SIM_POINTS = [  # (model, seq_len, devices, global batch)
    ("gpt2-124m", 1024, 64, 64),
    ("gpt2-124m", 1024, 128, 256),
    ("gpt2-350m", 1024, 64, 64),
    ("gpt2-350m", 1024, 256, 256),
    ("gpt2-774m", 1024, 128, 128),
    ("gpt2-1.5b", 1024, 128, 256),
]


def workload(model: str, seq: int, batch: int, precision: str = "bf16"):
    from behemoth.config import load_config
    from behemoth.planner.layout import Workload

    return Workload.of(load_config(None, [f"model={model}", f"train.seq_len={seq}", f"train.global_batch={batch}", f"train.precision={precision}"]))


def simulate(rows: list[dict]) -> None:
    from behemoth.planner.burst import simulate_cluster
    from behemoth.planner.cluster import load_cluster

    print("\n## simulated clusters (planner cost model; bf16; background: same model, 8 per device, 50% of solo rate)\n")
    print("| cluster | model | devices | batch/dev | DP ms | burst ms | burst plan | DP idle | burst idle | foreground | DP + bg | burst + bg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for preset in ("a100-80gb", "h100-sxm"):
        for model, seq, world, batch in SIM_POINTS:
            p = simulate_cluster(workload(model, seq, batch), load_cluster(preset), world)
            print(
                f"| {preset} | {model} | {world} | {p.per_device_batch:g} | {p.dp_step * 1e3:.1f} | {p.burst.step_seconds * 1e3:.1f} | "
                f"{p.burst.describe()} | {p.dp.idle_fraction:.0%} | {p.burst.idle_fraction:.0%} | {p.foreground_ratio:.2f}x | "
                f"{p.dp_multiplexed:.2f}x | {p.cluster_throughput:.2f}x |"
            )
            case = f"simulated {preset} {model} x{world}"
            rows.append(ratio("burst", case, "data parallelism", "cluster throughput", p.cluster_throughput, 1.0))
            rows.append(ratio("burst", case, "data parallelism + background", "cluster throughput", p.cluster_throughput, p.dp_multiplexed))


def training_adamw(params: Any) -> Any:
    """torch's AdamW with the kernel `behemoth train` picks on this device (fused on CPU, where torch's own default
    is the slower for-loop), as `behemoth calibrate` times it."""
    import torch

    from behemoth.config import TrainConfig
    from behemoth.parallel.sync import adamw_settings

    return torch.optim.AdamW(params, lr=1e-3, **adamw_settings(TrainConfig(), torch.device("cpu")).kernel_flags())


def foreground_rank(model: str, seq: int, batch: int, widths: tuple[int, ...], steps: int, warmup: int, overlap: bool = True) -> dict:
    """One rank of the foreground: `steps` timed AdamW steps of the burst plan `widths`; the rank's median step, its
    parts (forward + backward with the re-sharding and the loss sum, the gradient sums (`overlap`: what is left of
    them after backward), the optimizer step) and its CPU seconds per step."""
    import torch
    import torch.distributed as dist

    from behemoth.comm import all_reduce, barrier
    from behemoth.models.causal_lm import build_causal_lm, counted_targets, summed_token_loss
    from behemoth.models.gpt import GPTConfig
    from behemoth.models.init import materialize
    from behemoth.parallel.burst import BurstGroups, BurstModel

    lm = build_causal_lm(GPTConfig(preset=model, context=seq))
    materialize(lm.module, seed=0, device=torch.device("cpu"), init_spec=lm.init_spec)
    burst = BurstModel(lm, widths, BurstGroups.of(widths, dist.group.WORLD, torch.device("cpu")), batch=batch)
    opt = training_adamw(lm.module.parameters())
    parts: dict[str, list[float]] = {"step_s": [], "passes_s": [], "sync_s": [], "optimizer_s": [], "cpu_s": []}
    for step in range(warmup + steps):
        tokens = torch.randint(0, lm.shape.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(step))
        idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        count = int(counted_targets(targets))
        barrier(dist.group.WORLD)
        c0, t0 = time.process_time(), time.perf_counter()  # BurstModel.step, timed by part (CPU: this process's threads)
        local = burst.forward_backward(idx, targets, lambda logits, t, n=count: summed_token_loss(logits, t) / n, overlap=overlap)
        all_reduce((local * count).reshape(1).clone(), burst.groups.job)
        t1 = time.perf_counter()
        burst.sync_gradients()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        barrier(dist.group.WORLD)
        if step >= warmup:
            for key, seconds in zip(parts, (time.perf_counter() - t0, t1 - t0, t2 - t1, t3 - t2, time.process_time() - c0)):
                parts[key].append(seconds)
    return {key: statistics.median(v) for key, v in parts.items()}


def run_foreground(nproc: int, model: str, seq: int, batch: int, widths: tuple[int, ...], steps: int, warmup: int = 2) -> tuple[float, float]:
    """(rank 0's median step seconds, the ranks' CPU seconds per step summed)."""
    parts = run_foreground_parts(nproc, model, seq, batch, widths, steps, warmup)
    return parts["step_s"], parts["cpu_all_s"]


def run_foreground_parts(
    nproc: int, model: str, seq: int, batch: int, widths: tuple[int, ...], steps: int, warmup: int = 2, overlap: bool = True
) -> dict:
    from behemoth.faults.ranks import run_ranks

    ranks = run_ranks(nproc, foreground_rank, model, seq, batch, widths, steps, warmup, overlap, timeout=1800)
    return ranks[0] | {"cpu_all_s": sum(r["cpu_s"] for r in ranks)}


def local_plan(nproc: int, model: str, seq: int, batch: int, amplification: float, *, measure_links: bool = False):
    """The planner's burst plan for this machine: `behemoth calibrate`'s cached spec where there is one, else (with
    `measure_links`) a fresh quick calibration of `nproc` ranks (links, matmul rates and memory bandwidth measured with
    every rank at once, about 10 s), else the one-process probe (links assumed)."""
    from behemoth.errors import BehemothError
    from behemoth.planner.burst import BurstProblem, plain_data_parallel
    from behemoth.planner.calibrate import cached_spec_path, calibrate, local_cluster, probe_spec

    work = workload(model, seq, batch, "fp32")
    try:
        if measure_links and not cached_spec_path(nproc).is_file():
            with tempfile.TemporaryDirectory() as tmp:
                cluster = calibrate(nproc, mode="quick", cache_dir=tmp).with_nodes(nproc)
            cluster = cluster.model_copy(update={"name": f"behemoth calibrate --nproc {nproc}, quick, just now"})
        else:
            cluster = local_cluster(nproc).with_nodes(nproc)
    except BehemothError as err:  # a cached calibration this version cannot read
        print(f"(this machine's cached calibration is unreadable here: {err.lines[0]}; using the quick probe instead)")
        cluster = probe_spec(nproc).with_nodes(nproc)
    problem = BurstProblem(work, cluster, nproc)
    return problem.solve(amplification), plain_data_parallel(work, cluster, nproc), cluster.name, problem


def measured_plans(planned: tuple[int, ...], world: int) -> list[tuple[int, ...]]:
    """The plans `--part measure` runs: the planner's, data parallelism, every layer on one rank, the blocks on one
    rank (and, past 2 ranks, on half of them), the embedding alone on one rank, the head alone on one rank."""
    n = len(planned)
    plans = [planned, (world,) * n, (1,) * n, forced_plan(planned, world), (1, *([world] * (n - 1))), (*([world] * (n - 1)), 1)]
    if world > 2:
        plans.append(middle_plan(planned, world))
    return list(dict.fromkeys(plans))


def measure(args: argparse.Namespace, rows: list[dict]) -> tuple[int, ...]:
    """Several plans through the burst runtime in interleaved rounds (each plan's fastest round kept), each round after a
    fresh quick calibration of this machine (the fastest one kept: measurement and calibration alike take the least
    loaded moment they saw): the measured step and rank 0's parts against the planner's prediction and its parts."""
    n, batch = args.nproc, args.nproc * args.per_device
    load0 = os.getloadavg()[0]
    steps, rounds = (3, 1) if args.quick else (args.steps, args.rounds)
    best: dict[tuple[int, ...], dict] = {}
    chosen = None
    for _ in range(rounds):
        planned = local_plan(n, args.model, args.seq, batch, args.amplification, measure_links=True)
        if chosen is None or planned[3].plan_of((n,) * planned[3].layers).step_seconds < chosen[3].plan_of((n,) * chosen[3].layers).step_seconds:
            chosen = planned
        for widths in measured_plans(chosen[0].widths, n):
            got = run_foreground_parts(n, args.model, args.seq, batch, widths, steps)
            if widths not in best or got["step_s"] < best[widths]["step_s"]:
                best[widths] = got
    assert chosen is not None
    plan, _, name, problem = chosen
    plans = [w for w in measured_plans(plan.widths, n) if w in best]
    print(f"\n## measured on {n} CPU ranks ({name}): {args.model}, batch {batch} x {args.seq}, the planner's plan {plan.widths}")
    adamw = problem.cluster.device.adamw
    if adamw is not None:
        held = sum(problem.costs[1].elements)
        print(f"(AdamW as calibrated: {adamw.fixed_us:.0f} us + {adamw.ns_per_element:.2f} ns per element; rank 0 steps {held:,} elements)")
    print(
        f"(fastest of {rounds} interleaved rounds of {steps} steps, each after a quick calibration, the fastest calibration kept; "
        f"load average {load0:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)\n"
    )
    print(
        "| plan | measured ms | predicted ms | measured / predicted | rank 0 passes ms (predicted compute + transfer) "
        "| sync ms (predicted) | optimizer ms (predicted) | CPU ms per step, all ranks |"
    )
    print("|---|---|---|---|---|---|---|---|")
    dp = (n,) * len(plan.widths)
    for widths in plans:
        got, want = best[widths], problem.plan_of(widths)
        p = want.parts
        label = " planner" if widths == plan.widths else " data parallelism" if widths == dp else ""
        print(
            f"| {widths}{label} | {got['step_s'] * 1e3:.1f} | {want.step_seconds * 1e3:.1f} | {got['step_s'] / want.step_seconds:.2f} | "
            f"{got['passes_s'] * 1e3:.1f} ({(p['compute'] + p['transfer']) * 1e3:.1f}) | {got['sync_s'] * 1e3:.1f} ({p['sync'] * 1e3:.1f}) | "
            f"{got['optimizer_s'] * 1e3:.1f} ({p['optimizer'] * 1e3:.1f}) | {got['cpu_all_s'] * 1e3:.1f} |"
        )
        rows.append(
            ratio("burst", f"measured {n} CPU ranks {widths}", "predicted", "step time", got["step_s"], want.step_seconds, higher_is_better=False)
        )
    errors = [abs(best[w]["step_s"] / problem.plan_of(w).step_seconds - 1) for w in plans]
    print(f"\nworst |measured / predicted - 1| over the plans: {max(errors):.0%} (median {statistics.median(errors):.0%})")
    forced = forced_plan(plan.widths, n)
    ratios = (best[forced]["step_s"] / best[dp]["step_s"], problem.plan_of(forced).step_seconds / problem.plan_of(dp).step_seconds)
    print(f"blocks on one rank / data parallelism step time: {ratios[0]:.2f} measured, {ratios[1]:.2f} predicted")
    return plan.widths if len(set(plan.widths)) > 1 or plan.widths[0] < n else forced


def trainer_rank(overrides: list[str]) -> dict:
    """One rank of `behemoth train` (the Trainer the command runs) on the current process group; rank 0 reports."""
    from behemoth.config import load_config
    from behemoth.topology import init_runtime
    from behemoth.train import Trainer

    cfg = load_config(None, overrides)
    rt = init_runtime(timeout_s=cfg.run.timeout_s, **cfg.parallel.degrees())
    trainer = Trainer(cfg, rt)
    cpu: list[float] = []
    step = trainer.engine.train_step

    def timed_step(*args: Any, **kwargs: Any) -> Any:  # this process's CPU seconds (all its threads) per step
        t0 = time.process_time()
        out = step(*args, **kwargs)
        cpu.append(time.process_time() - t0)
        return out

    trainer.engine.train_step = timed_step  # type: ignore[method-assign]
    summary = trainer.run()
    held = trainer.engine.model_state_bytes()
    return {"losses": summary["losses"], "cpu_s": cpu, "held_bytes": held["params"] + held["optimizer"]}


@dataclass(frozen=True)
class TrainerRun:
    step_s: float  # median step time after the warm-up, as metrics.jsonl records it
    cpu_s: float  # median over those steps of the CPU seconds all ranks spent in the step
    held_mb: list[float]  # per rank: parameters + AdamW state


def run_trainer(args: argparse.Namespace, run_dir: Path, batch: int, widths: tuple[int, ...] | None, steps: int, warmup: int = 2) -> TrainerRun:
    """`steps` trainer steps after `warmup`: the median step time and CPU seconds, and each rank's model states."""
    import json

    from behemoth.faults.ranks import run_ranks

    over = [f"model={args.model}", f"train.seq_len={args.seq}", f"train.global_batch={batch}", f"train.steps={warmup + steps}"]
    over += ["train.log_every=1", f"train.eval_every={warmup + steps}", "train.eval_batches=1", "checkpoint.every=0", "run.progress=false"]
    over += ["run.tensorboard=false", "run.timeout_s=300", f"run.dir={run_dir}"]
    if widths is not None:
        over.append("parallel.burst=[" + ",".join(map(str, widths)) + "]")
    ranks = run_ranks(args.nproc, trainer_rank, over, timeout=1800)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time_s"] for r in records if "step_time_s" in r and r.get("step", 0) > warmup]
    cpu = [sum(r["cpu_s"][i] for r in ranks) for i in range(warmup, warmup + steps)]
    return TrainerRun(statistics.median(times), statistics.median(cpu), [r["held_bytes"] / 2**20 for r in ranks])


def trainer(args: argparse.Namespace, rows: list[dict]) -> None:
    """The burst plan through behemoth's trainer (AdamW, clipping, metrics: parallel.burst) against its plain data
    parallelism (DataParallel's overlapped bucketed all-reduce) on the same world and batch, best of `--rounds`."""
    n, batch = args.nproc, args.nproc * args.per_device
    plan, dp_pred, name, problem = local_plan(n, args.model, args.seq, batch, args.amplification)
    widths = chosen_plan(args, plan.widths, n, middle=True)
    steps, tokens, load = 3 if args.quick else args.steps, batch * args.seq, os.getloadavg()[0]
    rounds = 1 if args.quick else args.rounds
    with tempfile.TemporaryDirectory() as tmp:
        runs = iter(range(1000))

        def one(system: str) -> dict[str, Any]:
            got = run_trainer(args, Path(tmp) / f"{system}{next(runs)}", batch, widths if system == "burst" else None, steps)
            return {"tokens_per_s": tokens / got.step_s, "cpu_s": got.cpu_s, "run": got}

        best = best_of_rounds(["burst", "dp"], rounds, one, lambda r: f"{r['run'].step_s * 1e3:.1f} ms, {r['cpu_s']:.3f} CPU s", {})
    burst, dp = (TrainerRun(tokens / best[k]["tokens_per_s"], best[k]["cpu_s"], best[k]["run"].held_mb) for k in ("burst", "dp"))
    pred = problem.plan_of(widths).step_seconds
    planned = "the planner's" if widths == plan.widths else f"{'given' if args.widths else 'a hand-made one'} (the planner's was {plan.describe()})"
    print(f"\n## behemoth train on {n} CPU ranks ({name}): {args.model}, batch {batch} x {args.seq}, parallel.burst={list(widths)} ({planned})")
    print(f"(best of {rounds} rounds each; load average {load:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)\n")
    print_trainer_table(tokens, [("parallel.burst", burst, pred), ("data parallelism", dp, dp_pred)])
    cpu = burst.cpu_s / dp.cpu_s
    print(f"\nburst / data parallelism: step time {burst.step_s / dp.step_s:.2f}x (predicted {pred / dp_pred:.2f}x), CPU seconds {cpu:.2f}x")
    case = f"trainer {n} CPU ranks"
    rows.append(ratio("burst", case, "data parallelism (trainer)", "step time", burst.step_s, dp.step_s, higher_is_better=False))
    rows.append(ratio("burst", case, "data parallelism (trainer)", "CPU seconds", burst.cpu_s, dp.cpu_s, higher_is_better=False))
    rows.append(ratio("burst", case, "predicted", "step time", burst.step_s, pred, higher_is_better=False))


def print_trainer_table(tokens: int, runs: list[tuple[str, TrainerRun, float]]) -> None:
    """One row per (label, measured run, predicted step seconds)."""
    print(
        "| trainer run | step ms (median) | CPU s per step, all ranks | tokens/s | predicted ms | measured / predicted | params + AdamW MB per rank |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, got, want in runs:
        held = " / ".join(f"{mb:.2f}" for mb in got.held_mb)
        ms, per_s = got.step_s * 1e3, tokens / got.step_s
        print(f"| {label} | {ms:.1f} | {got.cpu_s:.3f} | {per_s:.0f} | {want * 1e3:.1f} | {got.step_s / want:.2f} | {held} |")


def chosen_plan(args: argparse.Namespace, planned: tuple[int, ...], world: int, *, middle: bool = False) -> tuple[int, ...]:
    """`--widths` where given, else the planner's plan unless it keeps every layer on every rank; then a hand-made one
    with idle ranks (`middle`: the blocks on half the ranks, else on one)."""
    if args.widths:
        return tuple(int(w) for w in args.widths.split(","))
    if len(set(planned)) > 1 or planned[0] < world:
        return planned
    return middle_plan(planned, world) if middle and world > 2 else forced_plan(planned, world)


def middle_plan(widths: tuple[int, ...], world: int) -> tuple[int, ...]:
    """The embedding and the head on every rank, the blocks on half of them: widths strictly between 1 and the world."""
    return (world, *([world // 2] * (len(widths) - 2)), world)


def forced_plan(widths: tuple[int, ...], world: int) -> tuple[int, ...]:
    """Where the planner keeps every layer on every rank, a plan with idle time to multiplex: blocks on one rank."""
    return (world, *([1] * (len(widths) - 2)), world)


def background_worker(model: str, seq: int, batch: int, seconds: float, log: str) -> None:
    """A background training job: one process, AdamW steps for `seconds`; per finished step, a line in `log` of the
    time and the process's CPU seconds so far."""
    Path(log).touch()  # before the imports: the parent waits on this file
    import torch

    from behemoth.models.causal_lm import build_causal_lm, summed_token_loss
    from behemoth.models.gpt import GPTConfig
    from behemoth.models.init import materialize
    from behemoth.parallel.burst.multiplex import lower_priority

    torch.set_num_threads(1)
    lm = build_causal_lm(GPTConfig(preset=model, context=seq))
    materialize(lm.module, seed=1, device=torch.device("cpu"), init_spec=lm.init_spec)
    opt = training_adamw(lm.module.parameters())
    end, done = time.time() + seconds, 0
    with open(log, "a") as out:
        while time.time() < end:
            if done == 1:  # imported and warmed up at normal priority: from here on, the background's
                lower_priority()
            done += 1
            tokens = torch.randint(0, lm.shape.vocab_size, (batch, seq + 1))
            (summed_token_loss(lm.module(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.write(f"{time.time()} {time.process_time()}\n")
            out.flush()


def wait_for_steps(log: Path, steps: int, timeout_s: float = 300.0) -> None:
    """Wait until the background job has finished `steps` steps (its imports and first steps are not measured)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= steps:
            return
        time.sleep(0.5)
    raise RuntimeError(f"the background job finished fewer than {steps} steps in {timeout_s:.0f} s")


@dataclass(frozen=True)
class BackgroundRate:
    """What the background job did in a window: steps per wall second, CPU seconds per wall second."""

    steps_per_s: float
    cpu_per_s: float


def background_rate(log: Path, t0: float, t1: float) -> BackgroundRate:
    """The background job's rate within [t0, t1] (its CPU seconds between the last step before t0 and the last in it)."""
    stamps = [tuple(float(x) for x in line.split()) for line in log.read_text().splitlines() if line.strip()]
    inside = [cpu for t, cpu in stamps if t0 <= t <= t1]
    before = [cpu for t, cpu in stamps if t < t0]
    if t1 <= t0 or not inside:
        return BackgroundRate(0.0, 0.0)
    return BackgroundRate(len(inside) / (t1 - t0), (inside[-1] - (before[-1] if before else inside[0])) / (t1 - t0))


def background(args: argparse.Namespace, seconds: float, log: Path, cpus: list[int] | None):
    from behemoth.parallel.burst.multiplex import start_background

    argv = [sys.executable, __file__, "--worker", "--model", args.model, "--seq", str(args.seq), "--bg-batch", str(args.bg_batch)]
    argv += ["--seconds", str(seconds), "--log", str(log)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return start_background(argv, cpus=cpus, env=env, nice=0)  # it lowers itself once warmed up


def with_background(args: argparse.Namespace, log: Path, during: Callable[[], Any]) -> tuple[Any, BackgroundRate]:
    """Start the background job, wait for its first steps, run `during`; (its result, the background's rate meanwhile)."""
    job = background(args, 3600, log, None)
    try:
        wait_for_steps(log, 2)
        t0 = time.time()
        result = during()
        return result, background_rate(log, t0, time.time())
    finally:
        job.stop()


def multiplex(args: argparse.Namespace, widths: tuple[int, ...], rows: list[dict]) -> None:
    """The foreground alone, the background alone, both at once: the foreground's slowdown and the background's share
    of its solo rate, by wall time and by CPU seconds."""
    from behemoth.parallel.burst.multiplex import idle_ranks

    n, batch, steps = args.nproc, args.nproc * args.per_device, 3 if args.quick else args.steps
    window = 20.0 if args.quick else 60.0
    with tempfile.TemporaryDirectory() as tmp:
        _, solo_bg = with_background(args, Path(tmp) / "solo", lambda: time.sleep(window))
        alone = run_foreground(n, args.model, args.seq, batch, widths, steps)
        together, both_bg = with_background(args, Path(tmp) / "both", lambda: run_foreground(n, args.model, args.seq, batch, widths, steps))
    print(f"\n## multiplexing on {n} CPU ranks: foreground plan {widths}, background {args.model} x{args.bg_batch} at nice 19\n")
    print_multiplex_table(alone, together, solo_bg, both_bg)
    print(f"(the plan idles ranks {idle_ranks(widths, n)} most; ranks are not pinned to cores here, so neither is the background)")
    print(f"(load average {os.getloadavg()[0]:.1f} at the end; targets: foreground slowdown <= 10%, background >= 50% of solo)")
    rows.append(ratio("burst", f"multiplexed {n} ranks", "foreground alone", "step time", alone[0], together[0]))
    rows.append(ratio("burst", f"multiplexed {n} ranks", "background alone", "throughput share", both_bg.steps_per_s, solo_bg.steps_per_s))


def share(part: float, whole: float) -> str:
    return f"{part / whole:.0%} of solo" if whole else "no solo rate"


def print_multiplex_table(alone: tuple[float, float], together: tuple[float, float], solo: BackgroundRate, both: BackgroundRate) -> None:
    """Foreground (wall ms per step, CPU s per step over its ranks) and background (steps/s, CPU s per s), alone and
    multiplexed."""
    print("| measure | alone | multiplexed | ratio |")
    print("|---|---|---|---|")
    print(f"| foreground step ms (wall, median) | {alone[0] * 1e3:.1f} | {together[0] * 1e3:.1f} | slowdown {together[0] / alone[0] - 1:+.1%} |")
    print(f"| foreground CPU s per step (all ranks) | {alone[1]:.3f} | {together[1]:.3f} | {together[1] / alone[1] - 1:+.1%} |")
    print(f"| background steps/s (wall) | {solo.steps_per_s:.2f} | {both.steps_per_s:.2f} | {share(both.steps_per_s, solo.steps_per_s)} |")
    print(f"| background CPU s per wall s | {solo.cpu_per_s:.2f} | {both.cpu_per_s:.2f} | {share(both.cpu_per_s, solo.cpu_per_s)} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["simulate", "measure", "trainer", "multiplex", "all"], default="all")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--model", default="gpt-1m")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--per-device", type=int, default=1, help="sequences per rank (strong scaling: 1 or 2)")
    p.add_argument("--amplification", type=float, default=2.0)
    p.add_argument("--widths", help="a burst plan to run instead of the planner's, e.g. 4,2,2,2,2,4 (trainer part)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2, help="measure and trainer parts: each plan run this many times in turn, the best kept")
    p.add_argument("--bg-batch", type=int, default=8)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=60.0, help=argparse.SUPPRESS)
    p.add_argument("--log", help=argparse.SUPPRESS)
    add_report_args(p)
    args = p.parse_args(argv)
    if args.worker:
        background_worker(args.model, args.seq, args.bg_batch, args.seconds, args.log)
        return 0
    print(f"{command_line('bench_burst.py', argv)}  (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    rows: list[dict] = []
    if args.part in ("simulate", "all"):
        simulate(rows)
    widths = None
    if args.part in ("trainer", "all"):
        trainer(args, rows)
    if args.part in ("measure", "all"):
        widths = measure(args, rows)
    if args.part in ("multiplex", "all"):
        if widths is None:
            plan = local_plan(args.nproc, args.model, args.seq, args.nproc * args.per_device, args.amplification)[0]
            widths = plan.widths if len(set(plan.widths)) > 1 or plan.widths[0] < args.nproc else forced_plan(plan.widths, args.nproc)
        multiplex(args, widths, rows)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
