"""AdamW step time over a GPT's parameters: behemoth's optimizers with each of torch's kernels vs torch.optim.AdamW's default.

    python benchmarks/bench_optimizer.py                    # gpt-1m and gpt-20m, 2 threads
    python benchmarks/bench_optimizer.py --quick            # gpt-1m only, fewer steps

Rows: torch.optim.AdamW as a plain loop would build it (its default kernel on this device: the for-loop on CPU), then
behemoth's replicated AdamW (data parallelism, ZeRO-0) and ZeRO's sharded AdamW step (AdamFP32 over one flat shard, the
step ZeRO-1/2/3 and offload take) with the for-loop, foreach and fused kernels (`train.adamw`). Same parameters, same
gradients; seconds are the median of --steps steps after 2 warm-up steps. Ratio: the peer's time / this row's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from behemoth.config import load_config
from behemoth.models.causal_lm import build_causal_lm
from behemoth.models.init import materialize
from behemoth.parallel.sync import AdamWSettings, adamw_with_state, decays
from behemoth.parallel.zero.adam import AdamFP32, ShardPiece

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["gpt-1m", "gpt-20m"])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
