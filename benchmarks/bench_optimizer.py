"""AdamW step time: behemoth's optimizers with each of torch's kernels vs torch.optim.AdamW's default, and the 8-bit step.

    python benchmarks/bench_optimizer.py                    # gpt-1m and gpt-20m, 2 threads
    python benchmarks/bench_optimizer.py --quick            # gpt-1m only, fewer steps
    python benchmarks/bench_optimizer.py --part 8bit        # 8-bit AdamW on a 64M-element shard, 1 and 2 threads

--part kernels (the default). Rows: torch.optim.AdamW as a plain loop would build it (its default kernel on this
device: the for-loop on CPU), then behemoth's replicated AdamW (data parallelism, ZeRO-0) and ZeRO's sharded AdamW step
(AdamFP32 over one flat shard, the step ZeRO-1/2/3 and offload take) with the for-loop, foreach and fused kernels
(`train.adamw`). Same parameters, same gradients; seconds are the median of --steps steps after 2 warm-up steps.
Ratio: the peer's time / this row's.

--part 8bit: elements/s of one AdamW step over one --numel-element shard: behemoth's 8-bit step on the CPU
(`Adam8bit`, which steps through `blockwise8.BlockwiseAdam8`), bitsandbytes' `optimizer_update_8bit_blockwise` (the
same stored format, one call over the shard), torch.optim.AdamW with float32 moments (fused and foreach), and
torchao's AdamW8bit if it is importable (torch.compile: its compile time is the warm-up, reported apart). Each thread
count runs in its own process (OMP_NUM_THREADS set, so bitsandbytes' OpenMP loops follow it too); each round steps
every optimizer once, in turn, so load from other work falls on all of them; median and range over --rounds rounds
after one warm-up step. Also printed: how many of the 8-bit codes behemoth's and bitsandbytes' steps wrote alike,
from the same start and gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from behemoth.config import load_config
from behemoth.models.causal_lm import build_causal_lm
from behemoth.models.init import materialize
from behemoth.parallel.sync import AdamWSettings, adamw_with_state, decays
from behemoth.parallel.zero.adam import Adam8bit, AdamFP32, ShardPiece

KERNELS = ("for-loop", "foreach", "fused")


def model_params(preset: str) -> list[torch.nn.Parameter]:
    cfg = load_config(None, [f"model={preset}"])
    lm = build_causal_lm(cfg.model)
    materialize(lm.module, seed=0, device=torch.device("cpu"), init_spec=lm.init_spec)
    params = list(lm.module.parameters())
    g = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-2
    return params


def torch_default(params: list[torch.nn.Parameter]) -> Callable[[], None]:
    decay, no_decay = [p for p in params if decays(p.shape)], [p for p in params if not decays(p.shape)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95)).step


def replicated(params: list[torch.nn.Parameter], kernel: str) -> Callable[[], None]:
    settings = AdamWSettings(1e-4, (0.9, 0.95), 0.1, kernel)
    return adamw_with_state([p for p in params if decays(p.shape)], [p for p in params if not decays(p.shape)], settings).step


def sharded(params: list[torch.nn.Parameter], kernel: str) -> Callable[[], None]:
    flat = torch.cat([p.detach().flatten() for p in params])
    grad = torch.cat([p.grad.flatten() for p in params])
    pieces, at = [], 0
    for p in params:
        pieces.append(ShardPiece(at, p.numel(), decays(p.shape)))
        at += p.numel()
    state = {"m": torch.zeros_like(flat), "v": torch.zeros_like(flat)}
    adam, count = AdamFP32(AdamWSettings(1e-4, (0.9, 0.95), 0.1, kernel)), [0]

    def step() -> None:
        count[0] += 1
        adam.step(flat, grad, state, pieces, lr=1e-4, coef=1.0, step=count[0])

    return step


def seconds(step: Callable[[], None], steps: int) -> float:
    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bitsandbytes_step(peer: Adam8bit, grad: torch.Tensor, p: torch.Tensor, st: dict[str, torch.Tensor], k: int) -> None:
    """bitsandbytes' own 8-bit AdamW update, one call over the whole shard (as its optimizers call it per tensor)."""
    m, v, ma, va = st["m"], st["v"], st["m_absmax"], st["v_absmax"]
    peer.F.optimizer_update_8bit_blockwise(
        "adam", grad, p, m, v, 0.9, 0.95, 0.0, 0.0, 1e-8, k, 1e-4, peer.qmap1, peer.qmap2, ma, va, weight_decay=0.1
    )


def eight_bit_steps(n: int) -> tuple[dict[str, Callable[[int], None]], list[dict[str, torch.Tensor]]]:
    """One step (given its count) of each optimizer over its own n-element shard from zero state, one gradient for all;
    and the 8-bit states of behemoth's and bitsandbytes' steps, to compare."""
    settings, cpu, gen = AdamWSettings(1e-4, (0.9, 0.95), 0.1), torch.device("cpu"), torch.Generator().manual_seed(0)
    grad, start = torch.randn(n, generator=gen) * 1e-2, torch.randn(n, generator=gen)
    pieces = [ShardPiece(0, n, True)]
    ours, peer = Adam8bit(settings, cpu), Adam8bit(settings, cpu, kernel="bitsandbytes")
    (p1, s1), (p2, s2) = [(start.clone(), {k: torch.zeros(c, dtype=d) for k, (c, d) in ours.state_spec(pieces, n).items()}) for _ in range(2)]
    steps: dict[str, Callable[[int], None]] = {
        "behemoth 8-bit": lambda k: ours.step(p1, grad, s1, pieces, lr=1e-4, coef=1.0, step=k),
        "bitsandbytes 8-bit": lambda k: bitsandbytes_step(peer, grad, p2, s2, k),
    }
    param = torch.nn.Parameter(start.clone())
    param.grad = grad
    for kernel in ("fused", "foreach"):
        opt = torch.optim.AdamW([param], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, **{kernel: True})
        steps[f"torch AdamW float32, {kernel}"] = lambda k, opt=opt: opt.step()
    try:
        from torchao.optim import AdamW8bit  # not a dependency: measured when it is importable

        ao = torch.nn.Parameter(start.clone())
        ao.grad = grad
        ao_opt = AdamW8bit([ao], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
        steps["torchao AdamW8bit (compiled)"] = lambda k: ao_opt.step()
    except ImportError as e:
        print(f"torchao: not run ({e})", file=sys.stderr)
    return steps, [s1, s2]


def eight_bit_worker(n: int, rounds: int) -> dict[str, Any]:
    """Times of every optimizer's steps (interleaved by round) in this process, and the codes both 8-bit steps wrote."""
    steps, (ours, peer) = eight_bit_steps(n)
    times: dict[str, list[float]] = {name: [] for name in steps}
    warm: dict[str, float] = {}
    for k in range(1, rounds + 2):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step(k)
            if k == 1:
                warm[name] = time.perf_counter() - t0
            else:
                times[name].append(time.perf_counter() - t0)
    alike = min(float((ours[k] == peer[k]).double().mean()) for k in ("m", "v"))
    return {"times": times, "warm": warm, "alike": alike}


def eight_bit(args: argparse.Namespace) -> None:
    n, rounds = (int(4e6), 3) if args.quick else (int(args.numel), args.rounds)
    print(f"8-bit AdamW, one shard of {n / 1e6:.1f}M elements, median (range) of {rounds} rounds after a warm-up, torch {torch.__version__}")
    print("\n| threads | optimizer | state bytes per element | M elements/s | behemoth 8-bit / this |")
    print("|---:|---|---:|---:|---:|")
    notes = []
    for threads in args.thread_counts:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        cmd = [sys.executable, __file__, "--part", "8bit-worker", "--numel", str(n), "--rounds", str(rounds), "--threads", str(threads)]
        out = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
        rate = {name: [n / t / 1e6 for t in ts] for name, ts in out["times"].items()}
        ours = statistics.median(rate["behemoth 8-bit"])
        for name, r in rate.items():
            state = 8 if "float32" in name else 2 + 8 / 256
            print(
                f"| {threads} | {name} | {state:.2f} | {statistics.median(r):.1f} ({min(r):.1f}-{max(r):.1f}) | {ours / statistics.median(r):.2f} |"
            )
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        notes.append(f"{threads} thread(s): codes behemoth's and bitsandbytes' steps wrote alike after {rounds + 1} steps: {100 * out['alike']:.4f}%")
        notes.append(f"{threads} thread(s): load average after the run (1, 5, 15 min): {load}")
        if "torchao AdamW8bit (compiled)" in out["warm"]:
            notes.append(f"{threads} thread(s): torchao's first step (torch.compile) took {out['warm']['torchao AdamW8bit (compiled)']:.1f} s")
    print("\n" + "\n".join(notes))


def kernels(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    models, steps = (["gpt-1m"], 4) if args.quick else (args.models, args.steps)
    print(f"float32, {args.threads} threads, median of {steps} steps, torch {torch.__version__}")
    print("\n| model | parameters | optimizer | kernel | ms per step | torch default / this |")
    print("|---|---:|---|---|---:|---:|")
    for preset in models:
        params = model_params(preset)
        n = sum(p.numel() for p in params)
        peer = seconds(torch_default(params), steps)
        print(f"| {preset} | {n / 1e6:.1f}M | torch.optim.AdamW (default) | for-loop | {peer * 1e3:.2f} | 1.00 |")
        for name, build in (("behemoth replicated", replicated), ("behemoth ZeRO shard", sharded)):
            for kernel in KERNELS:
                t = seconds(build(params, kernel), steps)  # the same tensors: each step changes values, not the work
                print(f"| {preset} | {n / 1e6:.1f}M | {name} | {kernel} | {t * 1e3:.2f} | {peer / t:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["kernels", "8bit", "8bit-worker"], default="kernels")
    ap.add_argument("--models", nargs="*", default=["gpt-1m", "gpt-20m"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--thread-counts", type=int, nargs="+", default=[1, 2], help="--part 8bit: one process per count")
    ap.add_argument("--numel", type=float, default=64 * 2**20, help="--part 8bit: elements in the shard")
    ap.add_argument("--rounds", type=int, default=5, help="--part 8bit: timed steps of each optimizer")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.part == "8bit-worker":
        torch.set_num_threads(args.threads)
        print(json.dumps(eight_bit_worker(int(args.numel), args.rounds)))
    else:
        (eight_bit if args.part == "8bit" else kernels)(args)


if __name__ == "__main__":
    main()
