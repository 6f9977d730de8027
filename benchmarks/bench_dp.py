"""behemoth data parallelism vs torch DistributedDataParallel, and one behemoth process vs a plain loop.

Same model (built and initialized by behemoth), same batches, same AdamW and clipping on both
sides; only the gradient synchronization (or the engine around the step) differs. Run:

    python benchmarks/bench_dp.py [--steps 20] [--models gpt-1m,gpt-6m] [--quick] [--json FILE] [--set train.gemm=blas]
    python benchmarks/bench_dp.py --compile      # both sides compiled: train.compile=true against torch.compile(DDP(model))

The peers multiply with torch's default BLAS; behemoth with train.gemm (default auto: oneDNN on CPUs where it is faster).
With --compile each side takes its own compiled path: behemoth its regionally compiled blocks, the peer torch.compile of
its whole model (wrapped in DDP first, so DDP's optimizer splits the graph at its buckets, as torch documents); the
warm-up steps hold the compilation and are not timed.

Prints a markdown table: tokens/s (median step), the ratio behemoth / peer, and each rank's peak
resident memory (RSS, which includes ~300 MB of torch itself on every rank).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from typing import Any

MODELS = {
    "gpt-1m": ["model=gpt-1m", "train.global_batch=32"],
    "gpt-6m": ["model=gpt-1m", "model.n_layer=6", "model.d_model=256", "model.n_head=8", "model.context=256", "train.global_batch=16"],
}


def make_config(model: str, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    from behemoth.config import load_config

    return load_config(None, MODELS[model] + ["run.progress=false", *extra]).model_dump(mode="json")


def bench_rank(kind: str, cfg_dict: dict[str, Any], steps: int, warmup: int, cache: str = "") -> dict[str, Any]:
    """One rank of one variant: `behemoth` (Engine.train_step), `ddp`, or `plain` (single process)."""
    import torch.distributed as dist

    from behemoth.config import Config
    from behemoth.data import BatchLayout, BatchSampler, prepare_corpus
    from behemoth.engine import build_engine, lr_at
    from behemoth.topology import init_runtime

    cfg = Config.model_validate(cfg_dict)
    if cache:  # both sides' compiled code in the run's own folder (each rank compiles; none is read from earlier runs)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    rt = init_runtime()
    corpus = prepare_corpus(cfg.data.path, cfg.data.val_fraction, cfg.data.cache_dir)
    layout = BatchLayout.resolve(cfg.train.global_batch, cfg.train.micro_batch, rt.world_size)
    sampler = BatchSampler(corpus.train, cfg.seq_len, layout, rt.rank, cfg.train.seed)
    step_fn = build_engine(cfg, rt).train_step if kind == "behemoth" else peer_step(kind, cfg, rt)
    times = []
    for step in range(warmup + steps):
        batches = sampler.micro_batches(step)
        dist.barrier()
        t0 = time.perf_counter()
        step_fn(batches, lr_at(step, cfg.train))
        times.append(time.perf_counter() - t0)
    median = statistics.median(times[warmup:])
    return {"tokens_per_s": cfg.train.global_batch * cfg.seq_len / median, "rss_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def peer_step(kind: str, cfg: Any, rt: Any):
    """A training step written the way a PyTorch user writes it, with DDP when there are ranks."""
    import torch
    import torch.nn.functional as F
    from peers import plain_adamw

    from behemoth.models.gpt import build_gpt
    from behemoth.models.init import materialize

    model = build_gpt(cfg.model)
    materialize(model, seed=cfg.train.seed, device=rt.device, init_spec=model.init_spec)
    opt = plain_adamw(model, cfg.train)
    net = torch.nn.parallel.DistributedDataParallel(model) if kind == "ddp" else model
    if cfg.train.compile:  # the peer's own compiled path: the whole (DDP-wrapped) model
        net = torch.compile(net)

    def step(batches, lr):
        opt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(batches):
            ctx = ddp_module(net).no_sync() if kind == "ddp" and i < len(batches) - 1 else torch.enable_grad()
            with ctx:
                loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten()) / len(batches)
                loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()

    return step


def ddp_module(net: Any) -> Any:
    """The DDP module inside a compiled wrapper (torch.compile returns an OptimizedModule around it)."""
    return getattr(net, "_orig_mod", net)


def run(model: str, steps: int, warmup: int, extra: tuple[str, ...] = (), compiled: bool = False) -> list[dict[str, Any]]:
    from behemoth.faults.ranks import run_ranks

    cfg = make_config(model, extra + (("train.compile=true", "run.timeout_s=900") if compiled else ()))
    rows = []
    for ours, peer, world, threads in [("behemoth", "ddp", 2, 1), ("behemoth", "plain", 1, 2)]:
        with tempfile.TemporaryDirectory() as cache:
            a = run_ranks(world, bench_rank, ours, cfg, steps, warmup, cache if compiled else "", threads=threads, timeout=1800)
        with tempfile.TemporaryDirectory() as cache:
            b = run_ranks(world, bench_rank, peer, cfg, steps, warmup, cache if compiled else "", threads=threads, timeout=1800)
        rows.append(
            {
                "model": model,
                "procs": world,
                "peer": ("DDP" if peer == "ddp" else "plain PyTorch loop") + (", torch.compile" if compiled else ""),
                "ours": a[0]["tokens_per_s"],
                "theirs": b[0]["tokens_per_s"],
                "mem_ours": max(r["rss_peak_mb"] for r in a),
                "mem_theirs": max(r["rss_peak_mb"] for r in b),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    from ratios import add_report_args, ratio, write_rows

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--models", default="gpt-1m,gpt-6m")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for both sides (e.g. train.gemm=blas)")
    parser.add_argument("--compile", action="store_true", help="both sides compiled (train.compile=true; the peer torch.compile)")
    add_report_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.models = 4, 1, "gpt-1m"
    print("| model | processes | peer | behemoth tok/s | peer tok/s | ratio | behemoth peak RSS/rank MB | peer peak RSS/rank MB |")
    print("|---|---|---|---|---|---|---|---|")
    out = []
    for model in args.models.split(","):
        for r in run(model, args.steps, args.warmup, tuple(args.set), args.compile):
            print(
                f"| {r['model']} | {r['procs']} | {r['peer']} | {r['ours']:.0f} | {r['theirs']:.0f} | {r['ours'] / r['theirs']:.3f} "
                f"| {r['mem_ours']:.0f} | {r['mem_theirs']:.0f} |",
                flush=True,
            )
            case = f"{r['model']}, {r['procs']} process(es)"
            out += [
                ratio("data parallel", case, r["peer"], "tokens/s", r["ours"], r["theirs"]),
                ratio("data parallel", case, r["peer"], "peak RSS per rank", r["mem_ours"], r["mem_theirs"], higher_is_better=False),
            ]
    write_rows(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
