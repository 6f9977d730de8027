"""train.compile: behemoth's eager and regionally compiled steps per layout, and a plain transformers GPT-2 loop eager and
under torch.compile, on the same shape.

    python benchmarks/bench_compile.py                  # gpt-1m, 8 x 128 tokens, 2 threads: one process, dp=2, ZeRO-3, tp=2
    python benchmarks/bench_compile.py --quick          # gpt-tiny, 4 x 32 tokens, one process only

Each row runs in its own fresh processes (`behemoth train`, or the peer's loop), float32, AdamW (foreach), with the same
total thread count (`--threads`, split over the ranks). tokens/s: the global batch's tokens over the median step time of
the steps after the first; compile s: the seconds behemoth's first step (and its evaluations) spent compiling, which its
step times exclude, first with an empty inductor cache, then (`cached` row) with the cache the first run filled. The peer
is transformers' GPT2LMHeadModel of the same widths and depth (untied head, as behemoth's GPT), compiled whole by
torch.compile, timed the same way. Ratios: compiled / eager of the same system, and behemoth compiled / peer compiled.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "one process": (1, []),
    "dp=2": (2, ["parallel.dp=2"]),
    "ZeRO-3 dp=2": (2, ["parallel.dp=2", "parallel.zero_stage=3"]),
    "tp=2": (2, ["parallel.tp=2"]),
}


def behemoth_run(args: argparse.Namespace, nproc: int, options: list[str], compiled: bool, run_dir: Path, cache: Path) -> dict[str, float]:
    """One `behemoth train` run; its median step time after the first, and its compile seconds (closing line)."""
    cmd = [sys.executable, "-m", "behemoth", "train", "--nproc", str(nproc), f"model={args.model}", f"train.seq_len={args.seq}"]
    cmd += [f"train.global_batch={args.batch}", f"train.steps={args.steps}", "train.eval_every=0", "train.eval_batches=1", "train.warmup_steps=1"]
    cmd += ["train.peak_tflops=1", "checkpoint.every=0", "checkpoint.export=false", "run.progress=false", "run.tensorboard=false"]
    cmd += [f"run.dir={run_dir}", f"train.compile={str(compiled).lower()}", *options]
    env = os.environ | {"OMP_NUM_THREADS": str(max(1, args.threads // nproc)), "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode and "train.compile=true with" in out.stderr:  # a layout behemoth refuses to compile, before launch
        return {"refused": out.stderr.strip().splitlines()[-1]}
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    steps = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "step_time_s" in r]
    match = re.search(r"compiled in ([\d.]+) s", out.stdout)
    return {"step_s": statistics.median(r["step_time_s"] for r in steps[1:]), "compile_s": float(match.group(1)) if match else 0.0}


def peer_loop(model: str, seq: int, batch: int, steps: int, compiled: bool) -> None:
    """The peer, in this process: GPT2LMHeadModel of behemoth's preset widths, AdamW, random tokens; prints JSON."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from behemoth.models.gpt import PRESETS

    p = PRESETS[model]
    cfg = GPT2Config(
        n_layer=p["n_layer"], n_head=p["n_head"], n_embd=p["d_model"], n_positions=p["context"], vocab_size=p["vocab_size"], tie_word_embeddings=False
    )
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    net = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=True)
    fwd = torch.compile(net, dynamic=False) if compiled else net
    idx = torch.randint(0, p["vocab_size"], (batch, seq))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = fwd(input_ids=idx, labels=idx).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    first, step = times[0], statistics.median(times[1:])
    print(json.dumps({"step_s": step, "compile_s": first - step}))


def peer_run(args: argparse.Namespace, compiled: bool, cache: Path) -> dict[str, float]:
    """The peer's loop in a fresh process with all `--threads`."""
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import bench_compile as b; "
    code += f"b.peer_loop({args.model!r}, {args.seq}, {args.batch}, {args.steps}, {compiled})"
    env = os.environ | {"OMP_NUM_THREADS": str(args.threads), "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise RuntimeError(f"peer loop failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def row(system: str, layout: str, kind: str, r: dict[str, float], tokens: int, eager: dict[str, float] | None, note: str = "") -> dict[str, float]:
    """Print one table row (ratio: the eager row's step time / this one's); `r` back."""
    if "refused" in r:
        print(f"| {system} | {layout} | {kind} | - | - | - | - | refused before launch: {r['refused'][:160]} |", flush=True)
        return r
    ratio = f"{eager['step_s'] / r['step_s']:.2f}" if eager else "1.00"
    cells = [system, layout, kind, f"{tokens / r['step_s']:.0f}", f"{r['step_s'] * 1e3:.1f}", f"{r['compile_s']:.1f}", ratio, note]
    print("| " + " | ".join(cells) + " |", flush=True)
    return r


def bench_layout(args: argparse.Namespace, layout: str, tmp: Path, cache: Path, tokens: int) -> dict[str, float]:
    """behemoth eager, then compiled with the cache so far (empty for the first layout; rows of the same block shapes fill
    it for later ones), and for one process again with the cache its first run filled."""
    nproc, options = LAYOUTS[layout]
    note = "empty cache" if not any(cache.glob("*")) else "cache of the rows above"
    name = layout.replace(" ", "_").replace("=", "")
    eager = row("behemoth", layout, "eager", behemoth_run(args, nproc, options, False, tmp / f"{name}-eager", cache), tokens, None)
    got = row("behemoth", layout, "compiled", behemoth_run(args, nproc, options, True, tmp / f"{name}-compiled", cache), tokens, eager, note)
    if nproc == 1:
        again = behemoth_run(args, nproc, options, True, tmp / f"{name}-cached", cache)
        row("behemoth", layout, "compiled", again, tokens, eager, "cache of the run above")
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-1m")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--quick", action="store_true", help="gpt-tiny, 4 x 32 tokens, 4 steps, one process")
    args = ap.parse_args()
    if args.quick:
        args.model, args.seq, args.batch, args.steps, args.layouts = "gpt-tiny", 32, 4, 4, ["one process"]
    tokens = args.seq * args.batch
    print(f"{args.model}, {args.batch} x {args.seq} tokens, float32, {args.threads} threads in all, median of {args.steps - 1} steps after the first")
    print("\n| system | layout | mode | tokens/s | ms per step | compile s | compiled / eager | note |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "inductor"
        compiled = {layout: bench_layout(args, layout, Path(tmp), cache, tokens) for layout in args.layouts}
        peer_eager = row("transformers GPT-2", "one process", "eager", peer_run(args, False, cache), tokens, None)
        peer = row("transformers GPT-2", "one process", "torch.compile", peer_run(args, True, cache), tokens, peer_eager, "first step - median")
        if "step_s" in compiled.get("one process", {}):
            print(f"\nbehemoth compiled / transformers compiled (one process, tokens/s): {peer['step_s'] / compiled['one process']['step_s']:.2f}")


if __name__ == "__main__":
    main()
