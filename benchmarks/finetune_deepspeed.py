"""`bench_finetune.py --part zero-offload`: full fine-tuning of a Llama-shaped HF folder, behemoth vs DeepSpeed ZeRO-Offload.

One small random-weight Llama (bench_finetune.py's LLAMA, written by save_pretrained) is fine-tuned in full, float32,
over `--nproc` gloo ranks (ZeRO-2: gradients and Adam state sharded over the ranks) by four systems, each in its own
fresh processes, on the same token batches (`--batch` sequences of `--seq` tokens per step, split over the ranks; two
fixed batches in turn, so the loss falls), AdamW (betas 0.9/0.95, weight decay 0.1 on matrices only, constant LR),
global-norm clipping at 1.0:

- behemoth-zero2: `behemoth train hf.weights=FOLDER parallel.dp=N parallel.zero_stage=2`;
- behemoth-zero-offload: the same with `offload.optimizer=host` (ZeRO-Offload: the float32 moments and the step in host
  memory; on a CPU-only machine host memory is the compute memory, so nothing moves);
- deepspeed-zero2: DeepSpeed ZeRO-2 on its CPU accelerator with torch's AdamW (foreach);
- deepspeed-zero-offload: DeepSpeed ZeRO-2 with `offload_optimizer: cpu` and DeepSpeedCPUAdam (its C++ SIMD Adam,
  JIT-built with ninja on first use; the build is not timed: it happens before the first step).

A step is timed between barriers; the median after `--warmup` steps is kept (with `--rounds` > 1 each system keeps its
fastest round, and its least CPU time per step, the steadier figure on a shared machine). Memory is the rank's peak
resident set (VmHWM, the larger of the ranks) and its growth from just before the model was built. The loss curves
(global batch means) are printed side by side: they should agree to float32 rounding, since every system trains the
same objective from the same weights on the same data.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_finetune import LLAMA, save_llama, token_batches
from bench_zero import global_mean, proc_status_kb
from ratios import best_of_rounds, failure, ratio

SYSTEMS = ("behemoth-zero2", "behemoth-zero-offload", "deepspeed-zero2", "deepspeed-zero-offload")
PEERS = {"behemoth-zero-offload": "deepspeed-zero-offload", "behemoth-zero2": "deepspeed-zero2"}
LR, BETAS, DECAY = 1e-3, (0.9, 0.95), 0.1


def rank_batches(args: dict, rank: int, world: int) -> list[tuple[Any, Any]]:
    """This rank's rows of each step's global batch (two fixed batches in turn)."""
    fixed = token_batches(2, args["batch"], args["seq"])
    rows = slice(rank * args["batch"] // world, (rank + 1) * args["batch"] // world)
    return [(fixed[i % 2][0][rows], fixed[i % 2][1][rows]) for i in range(args["warmup"] + args["steps"])]


def behemoth_system(folder: str, args: dict, offload: bool) -> Callable[[tuple[Any, Any]], float]:
    """behemoth's engine as `behemoth train` builds it for the folder, at ZeRO-2 (with the moments on host: ZeRO-Offload)."""
    import torch.distributed as dist

    from behemoth.config import load_config
    from behemoth.engine import build_engine
    from behemoth.topology import init_runtime

    options = [f"hf.weights={folder}", f"parallel.dp={dist.get_world_size()}", "parallel.zero_stage=2"]
    options += [f"train.global_batch={args['batch']}", f"train.seq_len={args['seq']}", f"train.lr={LR}", "train.grad_clip=1.0"]
    options += [f"train.beta1={BETAS[0]}", f"train.beta2={BETAS[1]}", f"train.weight_decay={DECAY}"]
    cfg = load_config(None, options + (["offload.optimizer=host"] if offload else []))
    engine = build_engine(cfg, init_runtime(timeout_s=600, **cfg.parallel.degrees()))
    return lambda batch: engine.train_step([batch], LR).loss


def deepspeed_system(folder: str, args: dict, offload: bool) -> Callable[[tuple[Any, Any]], float]:
    """DeepSpeed ZeRO-2 on its CPU accelerator over the gloo group: transformers' model of the folder, torch's AdamW or
    (offload_optimizer: cpu) DeepSpeedCPUAdam, with the same decay groups."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import transformers

    deepspeed.init_distributed(dist_backend="gloo")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa", dtype=torch.float32)
    params = list(model.parameters())
    decay, rest = [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": DECAY}, {"params": rest, "weight_decay": 0.0}]
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        opt: Any = DeepSpeedCPUAdam(groups, lr=LR, betas=BETAS, adamw_mode=True)
    else:
        opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, foreach=True)
    zero: dict[str, Any] = {"stage": 2, **({"offload_optimizer": {"device": "cpu"}} if offload else {})}
    config = {
        "train_micro_batch_size_per_gpu": args["batch"] // dist.get_world_size(),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)

    def step(batch: tuple[Any, Any]) -> float:
        x, y = batch
        loss = F.cross_entropy(engine(input_ids=x).logits.flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
        return global_mean(loss)

    return step


def run_system(name: str, folder: str, args: dict) -> dict[str, Any]:
    """One rank of `name`: its step times, losses and memory (runs inside run_ranks)."""
    import torch.distributed as dist

    rss0 = proc_status_kb("VmRSS")
    build = behemoth_system if name.startswith("behemoth") else deepspeed_system
    step = build(folder, args, offload=name.endswith("offload"))
    times, cpu, losses = [], [], []
    for batch in rank_batches(args, dist.get_rank(), dist.get_world_size()):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step(batch))
        dist.barrier()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    step_s, peak = statistics.median(times[args["warmup"] :]), proc_status_kb("VmHWM")
    out = {"tokens_per_s": args["batch"] * args["seq"] / step_s, "step_s": step_s, "cpu_s": statistics.median(cpu[args["warmup"] :])}
    return out | {"losses": losses, "peak_mib": peak / 1024, "grown_mib": (peak - rss0) / 1024}


def measure(folder: str, args: dict) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Each system in fresh processes, `rounds` times in turn; its fastest round (memory: the larger rank)."""
    from behemoth.faults.ranks import run_ranks

    def run(name: str) -> dict[str, Any]:
        ranks = run_ranks(args["nproc"], run_system, name, folder, args, timeout=3600.0)
        return {
            "tokens_per_s": min(x["tokens_per_s"] for x in ranks),
            "step_s": max(x["step_s"] for x in ranks),
            "cpu_s": max(x["cpu_s"] for x in ranks),
            "losses": ranks[0]["losses"],
            "peak_mib": max(x["peak_mib"] for x in ranks),
            "grown_mib": max(x["grown_mib"] for x in ranks),
        }

    def label(row: dict[str, Any]) -> str:
        return f"{row['tokens_per_s']:>7.0f} tokens/s  CPU {row['cpu_s']:.2f} s/step  peak RSS {row['peak_mib']:.0f} MiB/rank"

    failed: dict[str, str] = {}
    return best_of_rounds(list(SYSTEMS), args["rounds"], run, label, failed), failed


def print_tables(results: dict[str, dict[str, Any]], failed: dict[str, str], args: dict) -> None:
    print(
        f"\nFull fine-tuning, {args['nproc']} gloo ranks x 1 thread, float32, ZeRO-2: Llama {LLAMA}, batch {args['batch']} x {args['seq']} "
        f"tokens per step, median of {args['steps']} steps after {args['warmup']}, best of {args['rounds']} round(s)\n"
    )
    print("| system | tokens/s | step s | CPU s/step (rank max) | peak RSS MiB/rank | RSS growth MiB/rank | first / last loss |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['tokens_per_s']:.0f} | {r['step_s']:.2f} | {r['cpu_s']:.2f} | {r['peak_mib']:.0f} | {r['grown_mib']:.0f} | "
            f"{r['losses'][0]:.4f} / {r['losses'][-1]:.4f} |"
        )
    for name, why in failed.items():
        print(f"| {name} | failed: {why.strip().splitlines()[-1][:200]} | | | | | |")
    for ours, theirs in PEERS.items():
        if {ours, theirs} <= set(results):
            b, d = results[ours], results[theirs]
            print(
                f"\n{ours} / {theirs}: tokens/s x{b['tokens_per_s'] / d['tokens_per_s']:.2f}, CPU time x{b['cpu_s'] / d['cpu_s']:.2f}, "
                f"peak RSS x{b['peak_mib'] / d['peak_mib']:.2f} "
                f"(above 1: more memory), RSS growth x{b['grown_mib'] / d['grown_mib']:.2f}"
            )
    print_losses(results)


def print_losses(results: dict[str, dict[str, Any]]) -> None:
    """The loss curves side by side, with each system's largest relative difference from the first one's."""
    names = list(results)
    if not names:
        return
    ref = results[names[0]]["losses"]
    print("\n| step | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for i in range(len(ref)):
        print(f"| {i + 1} | " + " | ".join(f"{results[n]['losses'][i]:.7f}" for n in names) + " |")
    diffs = {n: max(abs(a - b) / abs(a) for a, b in zip(ref, results[n]["losses"], strict=True)) for n in names[1:]}
    print("\nlargest relative loss difference from " + names[0] + ": " + ", ".join(f"{n} {d:.1e}" for n, d in diffs.items()))


def bench_zero_offload(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run the four systems on one saved folder; print the tables; the ratio rows (behemoth to DeepSpeed)."""
    opts = {"nproc": args.nproc, "batch": args.batch, "seq": args.seq, "warmup": args.warmup, "rounds": args.rounds}
    opts["steps"] = args.steps - args.warmup  # timed steps (--steps counts the warm-up too, as in --part lora)
    with tempfile.TemporaryDirectory(prefix="bench-zero-offload-") as tmp:
        save_llama(Path(tmp) / "llama", args.seq)
        results, failed = measure(str(Path(tmp) / "llama"), opts)
    print_tables(results, failed, opts)
    rows = [failure("finetune-full", name, why) for name, why in failed.items()]
    case = f"llama-{LLAMA['hidden_size']}x{LLAMA['num_hidden_layers']} full ZeRO-2 {args.nproc} ranks b{args.batch}x{args.seq}"
    for ours, theirs in PEERS.items():
        if {ours, theirs} <= set(results):
            b, d = results[ours], results[theirs]
            rows.append(ratio("finetune-full", f"{case} {ours}", theirs, "tokens_per_s", b["tokens_per_s"], d["tokens_per_s"]))
            rows.append(ratio("finetune-full", f"{case} {ours}", theirs, "peak_mb", b["peak_mib"], d["peak_mib"], higher_is_better=False))
    return rows
