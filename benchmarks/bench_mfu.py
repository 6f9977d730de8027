"""MFU of one training process against the measured matmul peak: behemoth eager and compiled, its CPU float32 linears
by torch's BLAS and by oneDNN (train.gemm=blas / onednn), beside a plain transformers GPT-2 + AdamW loop eager and under
torch.compile, on the same shape.

    OMP_NUM_THREADS=2 python benchmarks/bench_mfu.py              # gpt2-124m, 4 x 512 tokens, float32, 2 threads
    OMP_NUM_THREADS=2 python benchmarks/bench_mfu.py --quick      # gpt-20m, 4 x 128 tokens
    OMP_NUM_THREADS=2 python benchmarks/bench_mfu.py --profile 14 --set train.loss_chunk=0   # the plain loss; top ops

One child process per mode (eager, compiled) holds behemoth's engines (one per train.gemm) and the peer's model at once
and alternates them step by step, each step right after a timing of the peak (a float32 2048^3 matmul at the process's
threads, by torch's BLAS and by oneDNN: the peak is the faster of the two, metrics.measure_peak_tflops), so all see the
same moment of a shared machine. The peer runs torch's default BLAS, as a user's plain loop does. FLOPs per step are behemoth's MFU count for both
(6 x the matmul parameters + attention, models/shape.py; the peer is the same shape). Reported per system:

- MFU (wall): FLOPs over the fastest step, divided by the fastest peak timing of the run;
- MFU (CPU): FLOPs per CPU second of the least-CPU step, divided by the peak matmul's FLOPs per CPU second (its
  least-CPU timing): the steadier of the two when other work loads the machine (both sides pay the same contention).

`--separate` runs behemoth's engines in one child and the peer in another, one after the other, each timing the peak
beside its own steps: the systems then share no allocator, caches or compiled-code state (the peer's 50,257-wide
logits and graphs stay out of behemoth's process), at the price of not seeing the same moment of the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from ratios import add_report_args, command_line, ratio, write_rows  # noqa: E402

Step = Callable[[], None]
GEMMS = ("blas", "onednn")  # behemoth's engines per mode, by train.gemm


def timed(fn: Step) -> tuple[float, float]:
    """Wall and process CPU seconds of fn() (CPU summed over the process's threads)."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def behemoth_step(model: str, batch: int, seq: int, compiled: bool, run_dir: str, tokens: Any, extra: list[str], gemm: str) -> tuple[Step, float]:
    """behemoth's engine as `behemoth train` builds it for one process, its linears by `gemm` (train.gemm); its step and
    its FLOPs per step. The step sets the process's train.gemm first (another engine in this process may have changed it)."""
    from behemoth.config import load_config
    from behemoth.engine import build_engine
    from behemoth.models.gemm import set_gemm
    from behemoth.topology import init_runtime

    opts = [f"model={model}", f"train.seq_len={seq}", f"train.global_batch={batch}", f"train.compile={str(compiled).lower()}"]
    opts += [f"run.dir={run_dir}", f"train.gemm={gemm}", *extra]
    cfg = load_config(None, opts)
    engine = build_engine(cfg, init_runtime())
    batches = [(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())]

    def step() -> None:
        set_gemm(cfg.train.gemm)
        engine.train_step(batches, 1e-4)

    return step, engine.model.lm.flops_per_token(seq) * batch * seq


def peer_step(model: str, compiled: bool, tokens: Any, adamw: str) -> Step:
    """transformers' GPT2LMHeadModel of the preset's widths (tied as the preset is), torch's AdamW, clipping at 1.0."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from behemoth.models.gpt import PRESETS

    p = PRESETS[model]
    cfg = GPT2Config(
        n_layer=p["n_layer"],
        n_head=p["n_head"],
        n_embd=p["d_model"],
        n_positions=p["context"],
        vocab_size=p["vocab_size"],
        tie_word_embeddings=bool(p.get("tie_embeddings")),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    net = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, **{adamw: True})
    fwd = torch.compile(net, dynamic=False) if compiled else net
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step() -> None:
        logits = fwd(input_ids=x).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _discard(_: Any) -> None:
    """A timed product's result, dropped (a Step returns nothing)."""


def op_profile(fn: Step, top: int) -> list[tuple[str, float, int]]:
    """One step under torch.profiler: its `top` operators by self CPU time (name, self CPU seconds, calls), and the total
    as "(all operators)" first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    return [("(all operators)", total, 0)] + [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in events[:top]]


def child(
    model: str,
    batch: int,
    seq: int,
    compiled: bool,
    steps: int,
    warmup: int,
    adamw: str,
    extra: list[str],
    profile: int = 0,
    gemms: tuple = GEMMS,
    peer: bool = True,
) -> None:
    """One mode: every system (behemoth's engines by `gemms`, and the peer unless not `peer`), alternated step by step
    after a peak timing each way (then, with `profile`, one profiled step of each); prints one JSON line."""
    import torch

    from behemoth.metrics import PEAK_SIZE, onednn_matmul
    from behemoth.models.gpt import PRESETS

    tokens = torch.randint(0, PRESETS[model]["vocab_size"], (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    cpu_device = torch.device("cpu")
    libraries = ("blas", "onednn") if onednn_matmul(cpu_device) else ("blas",)
    with tempfile.TemporaryDirectory() as run_dir:
        systems: dict[str, Step] = {}
        flops = None
        for gemm in gemms:
            systems[f"behemoth {gemm}"], flops = behemoth_step(model, batch, seq, compiled, f"{run_dir}/{gemm}", tokens, extra, gemm)
        if peer:
            systems["peer"] = peer_step(model, compiled, tokens, adamw)
        out: dict[str, Any] = {"flops": flops, "threads": torch.get_num_threads(), "systems": list(systems)}
        out |= {f"peak_{lib}_{clock}": [] for lib in libraries for clock in ("wall", "cpu")}
        for name, fn in systems.items():
            out[name] = {"warmup_s": [timed(fn)[0] for _ in range(warmup)], "wall": [], "cpu": []}
        a = torch.randn(PEAK_SIZE, PEAK_SIZE)
        dnn = torch.ops.mkldnn._linear_pointwise
        products: dict[str, Step] = {"blas": lambda: _discard(a @ a), "onednn": lambda: _discard(dnn(a, a, None, "none", [], ""))}
        for _ in range(steps):
            for name, fn in systems.items():
                for lib in libraries:
                    products[lib]()  # the product warm again after the other's step
                    wall, cpu = timed(products[lib])
                    out[f"peak_{lib}_wall"].append(wall)
                    out[f"peak_{lib}_cpu"].append(cpu)
                wall, cpu = timed(fn)
                out[name]["wall"].append(wall)
                out[name]["cpu"].append(cpu)
        for name, fn in systems.items() if profile else ():
            out[name]["profile"] = op_profile(fn, profile)
    print(json.dumps(out))


def run_mode(args: argparse.Namespace, compiled: bool, cache: str) -> dict[str, Any]:
    """One mode's result: every system in one child process, or (`--separate`) behemoth's engines in one and the peer in
    another, run one after the other, their results merged."""
    if not args.separate:
        return run_child(args, compiled, cache, tuple(args.gemm), True)
    ours, theirs = run_child(args, compiled, cache, tuple(args.gemm), False), run_child(args, compiled, cache, (), True)
    merged = ours | {"systems": ours["systems"] + theirs["systems"], "peer": theirs["peer"]}
    for key in (k for k in theirs if k.startswith("peak_")):  # each child's peak timings: the faster counts
        merged[key] = ours.get(key, []) + theirs[key]
    return merged


def run_child(args: argparse.Namespace, compiled: bool, cache: str, gemms: tuple, peer: bool) -> dict[str, Any]:
    call = (args.model, args.batch, args.seq, compiled, args.steps, args.warmup, args.peer_adamw, args.set, args.profile, gemms, peer)
    code = f"import bench_mfu as b; b.child{call!r}"
    env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=7200)
    if res.returncode:
        raise RuntimeError(f"{'compiled' if compiled else 'eager'} run failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def peak_seconds(r: dict[str, Any], clock: str) -> float:
    """The peak product's least `clock` seconds (wall or cpu): the faster library's (the honest peak)."""
    return min(min(v) for k, v in r.items() if k.startswith("peak_") and k.endswith(f"_{clock}"))


def mfu(r: dict[str, Any], name: str) -> tuple[float, float]:
    """(wall MFU, CPU MFU) of one system in one mode's result, against the faster library's peak."""
    peak_flops = 2 * 2048**3
    wall = r["flops"] / min(r[name]["wall"]) / (peak_flops / peak_seconds(r, "wall"))
    cpu = r["flops"] / min(r[name]["cpu"]) / (peak_flops / peak_seconds(r, "cpu"))
    return wall, cpu


def print_profiles(mode: str, r: dict[str, Any]) -> None:
    """The profiled step of each system: its costliest operators' self CPU seconds and share of the step's operators."""
    print(f"\n{mode}: one profiled step, self time per operator (torch.profiler, its overhead included; the calling thread's clock)\n")
    print("| system | operator | self s | share | calls |")
    print("|---|---|---:|---:|---:|")
    for name in r["systems"]:
        (_, total, _), *ops = r[name]["profile"]
        print(f"| {name} | (all operators) | {total:.2f} | 100% | |")
        for op, sec, calls in ops:
            print(f"| {name} | `{op}` | {sec:.2f} | {100 * sec / total:.1f}% | {calls} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3, help="timed steps of each system, alternated")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of each system first (compilation among them)")
    ap.add_argument("--peer-adamw", default="foreach", choices=["foreach", "fused"], help="the peer's torch.optim.AdamW kernel")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="behemoth config overrides (e.g. train.adamw=foreach)")
    ap.add_argument("--modes", nargs="*", default=["eager", "compiled"], choices=["eager", "compiled"])
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="then profile one step of each system: its N costliest operators")
    ap.add_argument("--gemm", nargs="+", default=list(GEMMS), choices=["auto", "blas", "onednn"], help="behemoth's engines, by train.gemm")
    ap.add_argument(
        "--separate",
        action="store_true",
        help="behemoth's engines and the peer each in a process of its own, one after the other (default: one process, alternated)",
    )
    add_report_args(ap)
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.seq, args.steps, args.warmup = "gpt-20m", 128, 2, 1
    load = os.getloadavg()
    print(
        f"{args.model}, {args.batch} x {args.seq} tokens, float32, {os.environ.get('OMP_NUM_THREADS', 'default')} threads, "
        + ("a process per system" if args.separate else "one process"),
        *args.set,
    )
    print(f"load average before: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n")
    print("MFU against the faster peak (BLAS or oneDNN); speed-up = the peer's least CPU s per step / the system's\n")
    print("| mode | system | MFU (wall) | MFU (CPU) | fastest step s | least CPU s/step | tokens/s | speed-up vs peer (CPU s) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    rows, profiles = [], []
    with tempfile.TemporaryDirectory() as cache:
        for mode in args.modes:
            r = run_mode(args, mode == "compiled", cache)
            theirs = min(r["peer"]["cpu"])
            for name in r["systems"]:
                wall, cpu = mfu(r, name)
                tok = args.batch * args.seq / min(r[name]["wall"])
                label = f"behemoth, train.gemm={name.split()[1]}" if name != "peer" else f"transformers GPT-2 + AdamW ({args.peer_adamw})"
                cell = f"{theirs / min(r[name]['cpu']):.2f}" if name != "peer" else ""
                cells = [mode, label, f"{wall:.3f}", f"{cpu:.3f}", f"{min(r[name]['wall']):.2f}", f"{min(r[name]['cpu']):.2f}", f"{tok:.0f}", cell]
                print("| " + " | ".join(cells) + " |", flush=True)
                if name != "peer":
                    rows.append(
                        ratio(
                            "mfu",
                            f"{args.model} {mode} {name}",
                            "transformers GPT-2",
                            "CPU s per step",
                            min(r[name]["cpu"]),
                            theirs,
                            higher_is_better=False,
                        )
                    )
            for lib in ("blas", "onednn"):
                if f"peak_{lib}_wall" in r:
                    wall_s, cpu_s = min(r[f"peak_{lib}_wall"]), min(r[f"peak_{lib}_cpu"])
                    rate = f"{wall_s:.3f} ({2 * 2048**3 / wall_s / 1e9:.0f} GFLOP/s)"
                    print(f"| {mode} | peak: 2048^3 matmul by {lib} | - | - | {rate} | {cpu_s:.3f} | - | - |")
            profiles.append((mode, r))
    for mode, r in profiles if args.profile else ():
        print_profiles(mode, r)
    load = os.getloadavg()
    print(f"\nload average after: {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}; {command_line('bench_mfu.py', argv)}")
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
