"""behemoth context parallelism (parallel.cp=2, ring and Ulysses) vs one process, and torch's experimental one.

A fixed small GPT (4 layers, d_model 128, 4 heads, float32) runs one forward + backward over a single sequence of T
tokens: at cp=1 on one process, at cp=2 on two (each rank holds T/2 tokens: ring attention over load-balanced chunks,
or Ulysses' all-to-all to heads). For each T, doubling, it measures per rank the bytes autograd saves for backward
(activations: each storage once, parameters excluded; the memory that grows with T) and the peak RSS of the process,
and the step's tokens/s (T over the median of `--steps` steps). The longest trainable sequence is the longest T whose
activations fit `--budget-mb` per rank, found by running every T up to it (none is extrapolated). Run:

    python benchmarks/bench_context.py [--budget-mb 64] [--max-len 16384] [--steps 3]

The peer, torch.distributed.tensor.experimental.context_parallel, is tried on the same model, mesh and sequence;
where it does not run on this backend the table says why (its error).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
MODEL = dict(preset="gpt-1m", n_layer=4, n_head=4, d_model=128, vocab_size=256)


def build(context: int, mode: str | None) -> tuple[Any, Any]:
    """The GPT on this rank, and its context-parallel layout (None at cp=1)."""
    import torch
    import torch.distributed as dist

    from behemoth.models.causal_lm import build_causal_lm
    from behemoth.models.gpt import GPTConfig
    from behemoth.models.init import materialize
    from behemoth.parallel.context import ContextPolicy, apply_context_parallel

    lm = build_causal_lm(GPTConfig(**MODEL, context=context))
    materialize(lm.module, seed=0, device=torch.device("cpu"), init_spec=lm.init_spec)
    cp = apply_context_parallel(lm, dist.group.WORLD, ContextPolicy(mode)) if mode else None
    return lm, cp


def one_length(seq_len: int, mode: str | None, steps: int) -> dict[str, Any]:
    """Saved activation bytes, peak RSS and tokens/s of one forward + backward over one sequence of `seq_len`."""
    import torch

    from behemoth.models.causal_lm import summed_token_loss
    from behemoth.parallel.tensor.activations import SavedBytesMeter

    lm, cp = build(seq_len, mode)
    tokens = torch.randint(0, MODEL["vocab_size"], (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    x, y, pos = cp.shard(x, y) if cp else (x, y, None)
    meter = SavedBytesMeter({}, list(lm.module.parameters()))
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        with meter.measure() if i == 0 else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = summed_token_loss(lm.logits(x, pos), y)
        loss.backward()
        times.append(time.perf_counter() - t0)
    return {
        "activation_mb": sum(meter.by_region.values()) / 2**20,
        "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "tokens_per_s": seq_len / statistics.median(times[1:]),
    }


def sweep(mode: str | None, lengths: list[int], budget_mb: float, steps: int) -> list[dict[str, Any]]:
    """Every length in turn until one exceeds the budget on some rank (that one is reported too)."""
    import torch.distributed as dist

    from behemoth.comm import all_reduce

    out = []
    for seq_len in lengths:
        got = one_length(seq_len, mode, steps)
        worst = __import__("torch").tensor([got["activation_mb"]])
        all_reduce(worst, dist.group.WORLD, op=dist.ReduceOp.MAX)
        out.append({"seq_len": seq_len, **got, "fits": float(worst) <= budget_mb})
        if float(worst) > budget_mb:
            break
    return out


def torch_peer(seq_len: int) -> dict[str, Any]:
    """torch's context_parallel on behemoth's GPT (its own SDPA path): tokens/s, or the error that stopped it."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    from behemoth.models.causal_lm import summed_token_loss

    lm, _ = build(seq_len, None)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    tokens = torch.randint(0, MODEL["vocab_size"], (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    pos = torch.arange(seq_len).unsqueeze(0)
    try:
        t0 = time.perf_counter()
        with context_parallel(mesh, buffers=[x, y, pos], buffer_seq_dims=[1, 1, 1]):
            loss = summed_token_loss(lm.logits(x, pos), y)
            loss.backward()
        return {"tokens_per_s": seq_len / (time.perf_counter() - t0)}
    except Exception as err:  # the peer's own failure on this backend is the result
        return {"error": f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"[:300]}


def run(lengths: list[int], budget_mb: float, steps: int) -> dict[str, Any]:
    from behemoth.faults.ranks import run_ranks

    out = {"cp=1": run_ranks(1, sweep, None, lengths, budget_mb, steps, timeout=3600)[0]}
    for mode in ("ring", "ulysses"):
        out[f"cp=2 {mode}"] = run_ranks(2, sweep, mode, lengths, budget_mb, steps, timeout=3600)[0]
    out["peer"] = run_ranks(2, torch_peer, lengths[0], timeout=600)[0]
    return out


def print_table(results: dict[str, Any], budget_mb: float) -> None:
    base = {r["seq_len"]: r for r in results["cp=1"]}
    print(f"| layout | T | activations MiB/rank | vs cp=1 | peak RSS MB/rank | tokens/s | vs cp=1 | fits {budget_mb:g} MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("cp=1", "cp=2 ring", "cp=2 ulysses"):
        for r in results[name]:
            b = base.get(r["seq_len"]) if name != "cp=1" else None
            mem = f"{b['activation_mb'] / r['activation_mb']:.2f}x less" if b else "-"
            speed = f"{r['tokens_per_s'] / b['tokens_per_s']:.2f}" if b else "-"
            row = [
                name,
                r["seq_len"],
                f"{r['activation_mb']:.1f}",
                mem,
                f"{r['rss_mb']:.0f}",
                f"{r['tokens_per_s']:.0f}",
                speed,
                "yes" if r["fits"] else "no",
            ]
            print("| " + " | ".join(map(str, row)) + " |")
    print()
    for name in ("cp=1", "cp=2 ring", "cp=2 ulysses"):
        fit = [r["seq_len"] for r in results[name] if r["fits"]]
        print(f"- {name}: longest sequence within {budget_mb:g} MiB of activations per rank: {max(fit) if fit else 'none'}")
    peer = results["peer"]
    told = peer.get("error") or f"{peer['tokens_per_s']:.0f} tokens/s"
    print(f"- torch context_parallel (gloo, CPU): {told}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mb", type=float, default=64.0, help="activation MiB per rank a trainable sequence must fit")
    parser.add_argument("--min-len", type=int, default=1024)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per length (after one measured step)")
    from ratios import add_report_args, ratio, write_rows

    add_report_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.max_len, args.steps, args.budget_mb = 2048, 1, 16.0
    lengths, n = [], args.min_len
    while n <= args.max_len:
        lengths.append(n)
        n *= 2
    results = run(lengths, args.budget_mb, args.steps)
    print_table(results, args.budget_mb)
    rows = []
    longest = {k: max([r["seq_len"] for r in v if r["fits"]] or [0]) for k, v in results.items() if k != "peer"}
    for mode in ("ring", "ulysses"):
        if longest["cp=1"] and longest[f"cp=2 {mode}"]:
            rows.append(ratio("context parallel", f"cp=2 {mode}", "cp=1", "longest sequence", longest[f"cp=2 {mode}"], longest["cp=1"]))
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
