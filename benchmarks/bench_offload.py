"""Out-of-core training: the largest GPT plain PyTorch trains on this machine against behemoth with disk offload.

    python benchmarks/bench_offload.py --quick    # every section at toy sizes, a minute or two; writes nothing but scratch it removes
    python benchmarks/bench_offload.py            # hours: the numbers of benchmarks/README.md (run on a quiet machine)
    python benchmarks/bench_offload.py --only int8   # one part: plain, fp32, int8, deepspeed, orders (repeatable)

Sections (each measurement in a fresh process; one sequence of --seq tokens, float32, AdamW, two optimizer steps):

1. Plain PyTorch's ceiling: the largest GPT (n_layer at a fixed width) that trains one step with float32 AdamW, each
   probe in a subprocess whose address space is limited (RLIMIT_AS: --limit-gb above what a bare `import torch`
   reserves), so a probe that does not fit fails its allocation instead of waking the OOM killer.
2. behemoth with parameters and optimizer state on disk (Harmony order, a fused step: no clipping): the largest GPT the
   free disk allows, up to --fp32-params with float32 moments and --int8-params with 8-bit moments. Peak resident
   memory, bytes read and written per step, step time, and the bound max(read / read rate + written / write rate,
   FLOPs / compute rate) from a calibration of this machine in the same process; ratio step / bound (target <= 1.5).
3. DeepSpeed ZeRO-Offload (CPU Adam) and ZeRO-Infinity (NVMe, if its async_io op builds) against behemoth on a model
   all can run: tokens/s and peak resident memory.
4. Bytes swapped per step against micro-batches m = 1, 4, 16 for the naive and the Harmony order (counted).

Free disk is checked first; a run that cannot reach its target size says what it needs. Scratch goes under --dir and is
removed at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from offload_workers import RESULT, worker_main
from ratios import failure, ratio, write_rows

ROWS: list = []  # comparisons for `behemoth bench` (--json)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GiB = 2**30


def step_lr(n_layer: int, d: int) -> float:
    """The learning rate of the offloaded runs: 1e-4, or less for deep and wide models. Adam's first step moves every
    weight by about lr, and the change of the output grows with width x depth; at 25 layers of width 4096, 1e-4 raises
    the loss of the fixed sequence (measured: 6.26 -> 7.25), while lr x width x depth <= 0.5 lowers it (20 layers of
    width 1024 in memory: 1e-4 gave 5.71 -> 4.29 -> 5.34, 2.5e-5 gave 5.71 -> 4.22 -> 3.00)."""
    return min(1e-4, 0.5 / (n_layer * d))


# --- the parent: subprocesses, searches, tables ---


def run_worker(kind: str, spec: dict, *, threads: int, limit_bytes: int | None = None, timeout: float = 36000) -> dict | None:
    """A worker in a fresh process (address space limited to `limit_bytes`); its result, or None if it failed."""

    def limit() -> None:
        if limit_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", kind, json.dumps(spec)], capture_output=True, text=True, env=env, preexec_fn=limit, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return None
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"  {kind} worker failed ({proc.returncode}): {tail[:200]}", flush=True)
        return None
    return json.loads(lines[-1][len(RESULT) :])


def bare_torch_vsz(threads: int) -> int:
    """Bytes of address space a process that imported torch and behemoth holds before any model exists."""
    code = "import torch, behemoth.engine, re; print(re.search(r'VmSize:\\s+(\\d+)', open('/proc/self/status').read()).group(1))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    )
    return int(out.stdout.strip()) * 1024


def plain_ceiling(a: argparse.Namespace) -> dict:
    """Binary search over n_layer at width --plain-d for the largest GPT plain PyTorch trains under the limit."""
    limit = bare_torch_vsz(a.threads) + int(a.limit_gb * GiB)
    per_layer = 12 * a.plain_d**2
    guess = max(1, int(a.limit_gb * GiB / (16 * per_layer)))  # float32 AdamW: 16 bytes per parameter, activations aside
    lo, hi, best = 0, int(1.5 * guess) + 1, None
    while lo < hi:
        mid = min((lo + hi + 1) // 2, guess) if best is None and lo == 0 else (lo + hi + 1) // 2
        got = run_worker("plain", {"n_layer": mid, "d": a.plain_d, "heads": a.plain_heads, "seq": a.seq}, threads=a.threads, limit_bytes=limit)
        print(f"  plain PyTorch, {mid} layers x d {a.plain_d}: {'trains' if got else 'does not fit'}", flush=True)
        if got:
            lo, best = mid, {**got, "n_layer": mid}
        else:
            hi = mid - 1
    return {"limit_gb": a.limit_gb, **(best or {"params": 0, "n_layer": 0, "peak_rss_gib": 0.0})}


def disk_layers(free: int, per_layer: int, bytes_per_param: float, target: int, margin: float = 0.85) -> tuple[int, int]:
    """(layers the target needs, layers the free disk allows)."""
    return math.ceil(target / per_layer), int(free * margin / (per_layer * bytes_per_param))


def offload_size(a: argparse.Namespace, d: int, bits: int, target: int) -> tuple[int, str]:
    """The largest n_layer the free disk allows (at most what the target needs), and a note when it falls short."""
    per_layer = 12 * d * d + 13 * d
    bytes_per_param = 4 + (8 if bits == 32 else 2 + 8 / 256)
    free = shutil.disk_usage(a.dir).free
    need, room = disk_layers(free, per_layer, bytes_per_param, target)
    n = max(1, min(need, room))
    note = (
        ""
        if room >= need
        else (
            f"target {target / 1e9:.1f}B needs {need * per_layer * bytes_per_param / GiB:.0f} GiB of disk, "
            f"{free / GiB:.0f} GiB free: ran {n * per_layer / 1e9:.2f}B"
        )
    )
    print(
        f"  disk: {n} layers x d {d} at {bytes_per_param:.2f} bytes/parameter need {n * per_layer * bytes_per_param / GiB:.1f} GiB; "
        f"{free / GiB:.1f} GiB free{'; ' + note if note else ''}",
        flush=True,
    )
    return n, note


def offload_run(a: argparse.Namespace, d: int, heads: int, bits: int, target: int) -> dict | None:
    n, note = offload_size(a, d, bits, target)
    scratch = Path(tempfile.mkdtemp(prefix="bench-offload-", dir=a.dir))
    try:
        got = run_worker(
            "offload",
            {
                "n_layer": n,
                "d": d,
                "heads": heads,
                "seq": a.seq,
                "bits": bits,
                "dir": str(scratch / "s"),
                "budget_gb": a.budget_gb,
                "calibrate": True,
                "calibration_mb": a.calibration_mb,
                "lr": step_lr(n, d),
            },
            threads=a.threads,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return None if got is None else {**got, "note": note, "bits": bits, "lr": step_lr(n, d)}


def bound(run: dict) -> tuple[float, float, float]:
    """(I/O seconds, compute seconds, their max) for the last step, from the run's own calibration."""
    r = run["rates"]
    read = sum(x[0] for x in run["steps"][-1]["bytes"].values())
    written = sum(x[1] for x in run["steps"][-1]["bytes"].values())
    io = read / r["disk_read"] + written / r["disk_write"]
    compute = run["flops"] / r["compute"]
    return io, compute, max(io, compute)


def offload_table(plain: dict | None, runs: list[dict]) -> str:
    """The offloaded runs against plain PyTorch's ceiling (None: not measured this time, `--only`)."""
    rows = [
        "| system | parameters | x plain ceiling | peak RSS (GiB) | read / written per step (GiB) | step time (s) | bound (s): I/O, compute | step / bound | losses (step 1, 2, after) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    if plain is None:
        plain = {"params": 0}
    else:
        rows.append(
            f"| plain PyTorch float32 AdamW (limit {plain['limit_gb']:g} GiB) | {plain['params'] / 1e9:.3f}B | 1.0 | {plain['peak_rss_gib']:.2f} | - | - | - | - | {plain.get('loss', float('nan')):.4f} |"
        )
    for run in runs:
        io, compute, b = bound(run)
        last = run["steps"][-1]
        read = sum(x[0] for x in last["bytes"].values()) / GiB
        written = sum(x[1] for x in last["bytes"].values()) / GiB
        losses = ", ".join(f"{s['loss']:.4f}" for s in run["steps"]) + (f", {run['loss_after']:.4f}" if run["loss_after"] is not None else "")
        name = f"behemoth disk offload, {'float32' if run['bits'] == 32 else '8-bit'} moments (lr {run['lr']:.1g})"
        times = run["params"] / plain["params"] if plain["params"] else float("nan")
        if plain["params"]:
            ROWS.append(
                ratio(
                    "offload",
                    f"{'float32' if run['bits'] == 32 else '8-bit'} moments",
                    "plain PyTorch float32 AdamW",
                    "largest model trained",
                    run["params"],
                    plain["params"],
                )
            )
        rows.append(
            f"| {name} | {run['params'] / 1e9:.3f}B | {times:.1f} | {run['peak_rss_gib']:.2f} | {read:.2f} / {written:.2f} | "
            f"{last['seconds']:.1f} | {b:.1f}: {io:.1f}, {compute:.1f} | {last['seconds'] / b:.2f} | {losses} |"
        )
    rates = runs[0]["rates"] if runs else None
    tail = (
        ""
        if rates is None
        else (
            f"\ncalibration: disk read {rates['disk_read'] / 1e9:.2f} GB/s, write {rates['disk_write'] / 1e9:.2f} GB/s, "
            f"compute {rates['compute'] / 1e12:.3f} TFLOP/s"
        )
    )
    return "\n".join(rows) + tail + "\n" + "".join(f"\nnote: {r['note']}" for r in runs if r["note"])


def orders_table(a: argparse.Namespace) -> str:
    """Bytes read + written per step (steady state: the third step, deferred updates) for m = 1, 4, 16, both orders."""
    rows = ["| order | " + " | ".join(f"m={m}" for m in a.ms) + " |", "|---|" + "---:|" * len(a.ms)]
    for order in ("naive", "harmony"):
        cells = []
        for m in a.ms:
            scratch = Path(tempfile.mkdtemp(prefix="bench-orders-", dir=a.dir))
            try:
                got = run_worker(
                    "offload",
                    {
                        "n_layer": a.orders_layers,
                        "d": a.orders_d,
                        "heads": 4,
                        "seq": a.seq,
                        "bits": 32,
                        "m": m,
                        "order": order,
                        "grads": "disk",
                        "grad_clip": 1.0,
                        "dir": str(scratch / "s"),
                        "steps": 3,
                        "evaluate": False,
                    },
                    threads=a.threads,
                )
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            total = sum(r + w for r, w in got["steps"][-1]["bytes"].values()) / 2**20 if got else float("nan")
            cells.append(f"{total:,.1f} MiB")
            print(f"  {order} m={m}: {cells[-1]}", flush=True)
        rows.append(f"| {order} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def deepspeed_table(a: argparse.Namespace) -> str:
    """ZeRO-Offload (CPU Adam) and ZeRO-Infinity (NVMe) against behemoth on the same GPT, if DeepSpeed is installed."""
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return 'DeepSpeed is not installed (pip install -e ".[bench]"): section skipped.\n'
    shape = {"n_layer": a.ds_layers, "d": a.ds_d, "heads": a.ds_heads, "seq": a.seq}
    rows = ["| system | parameters | tokens/s (step 2) | peak RSS (GiB) | note |", "|---|---:|---:|---:|---|"]
    scratch = Path(tempfile.mkdtemp(prefix="bench-ds-", dir=a.dir))
    try:
        ours = run_worker("offload", {**shape, "bits": 32, "dir": str(scratch / "b"), "evaluate": False}, threads=a.threads)
        if ours:
            rows.append(
                f"| behemoth disk offload | {ours['params'] / 1e6:.1f}M | {a.seq / ours['steps'][-1]['seconds']:.1f} | {ours['peak_rss_gib']:.2f} | |"
            )
        for device, port in (("cpu", 29731), ("nvme", 29732)):
            if device == "nvme" and not a.nvme:
                rows.append("| DeepSpeed ZeRO-Infinity (NVMe) | - | - | - | skipped: --nvme not given (needs libaio-dev for its async_io op) |")
                continue
            got = run_worker("deepspeed", {**shape, "device": device, "dir": str(scratch / "ds"), "port": port}, threads=a.threads)
            name = "DeepSpeed ZeRO-Offload (CPU Adam)" if device == "cpu" else "DeepSpeed ZeRO-Infinity (NVMe)"
            if got and ours:
                ROWS.append(
                    ratio(
                        "offload",
                        f"{ours['params'] / 1e6:.0f}M GPT, one sequence of {a.seq}",
                        name,
                        "tokens/s",
                        a.seq / ours["steps"][-1]["seconds"],
                        a.seq / got["seconds"][-1],
                    )
                )
            elif not got:
                ROWS.append(failure("offload", name, "its worker failed (see the benchmark's log)"))
            rows.append(
                f"| {name} | {got['params'] / 1e6:.1f}M | {a.seq / got['seconds'][-1]:.1f} | {got['peak_rss_gib']:.2f} | |"
                if got
                else f"| {name} | - | - | - | failed: see the line above |"
            )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return "\n".join(rows) + "\n"


def available_gib() -> float:
    return int(re.search(r"^MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text(), re.M).group(1)) / 2**20


def settings(a: argparse.Namespace) -> argparse.Namespace:
    """--quick shrinks every size so that the whole benchmark runs in a minute or two; memory limits follow what is free."""
    a.limit_gb = a.limit_gb if a.limit_gb is not None else max(1.0, min(20.0, available_gib() - 3))
    a.budget_gb = a.budget_gb if a.budget_gb is not None else max(1.0, min(16.0, available_gib() - 4))
    if a.quick:
        a.limit_gb, a.plain_d, a.plain_heads = 0.25, 256, 4
        a.fp32_params, a.int8_params, a.d_fp32, a.d_int8, a.heads = 20e6, 40e6, 512, 512, 8
        a.budget_gb, a.calibration_mb, a.ms, a.orders_layers, a.orders_d = 0.25, 64, (1, 4), 2, 64
        a.ds_layers, a.ds_d, a.ds_heads, a.threads = 2, 128, 4, 1
    return a


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return worker_main(sys.argv[2], sys.argv[3])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="toy sizes: checks every section in a minute or two")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where scratch files go (its disk is the one measured)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument(
        "--limit-gb",
        type=float,
        help="address space for plain PyTorch above a bare torch process (default: the memory available now less 3 GiB, at most 20)",
    )
    p.add_argument("--plain-d", type=int, default=2048)
    p.add_argument("--plain-heads", type=int, default=16)
    p.add_argument("--fp32-params", type=float, default=5e9)
    p.add_argument("--int8-params", type=float, default=10e9)
    p.add_argument("--d-fp32", type=int, default=4096)
    p.add_argument("--d-int8", type=int, default=5120)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--budget-gb", type=float, help="offload.max_memory_gb of the big runs (default: available memory less 4 GiB, at most 16)")
    p.add_argument("--calibration-mb", type=int, default=1024)
    p.add_argument("--ms", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--orders-layers", type=int, default=4)
    p.add_argument("--orders-d", type=int, default=256)
    p.add_argument("--ds-layers", type=int, default=8)
    p.add_argument("--ds-d", type=int, default=1024)
    p.add_argument("--ds-heads", type=int, default=16)
    p.add_argument("--nvme", action="store_true", help="also run DeepSpeed ZeRO-Infinity on NVMe (its async_io op needs libaio-dev)")
    p.add_argument("--json", metavar="FILE", help="also write the ratio rows to FILE (for `behemoth bench`)")
    p.add_argument("--only", action="append", choices=PARTS, help="run only these parts (repeatable; default: all)")
    a = settings(p.parse_args(argv))
    print(
        f"bench_offload{' --quick' if a.quick else ''}: scratch under {a.dir} ({shutil.disk_usage(a.dir).free / GiB:.1f} GiB free), "
        f"{a.threads} thread(s), one sequence of {a.seq} tokens; plain PyTorch limited to {a.limit_gb:.1f} GiB, "
        f"offload.max_memory_gb={a.budget_gb:.1f}",
        flush=True,
    )
    t0 = time.perf_counter()
    parts = set(a.only or PARTS)
    plain = None
    if "plain" in parts:
        section("1. plain PyTorch's ceiling", t0)
        plain = plain_ceiling(a)
    if parts & {"fp32", "int8"}:
        section("2. behemoth, disk offload", t0)
        sizes = [(a.d_fp32, 32, a.fp32_params)] * ("fp32" in parts) + [(a.d_int8, 8, a.int8_params)] * ("int8" in parts)
        runs = [r for r in (offload_run(a, d, a.heads, bits, int(n)) for d, bits, n in sizes) if r]
        print(offload_table(plain, runs))
        if a.quick:
            print("(quick: the scratch fits the page cache, so steps can beat a bound computed from the disk's raw rates)")
    if "deepspeed" in parts:
        section("3. DeepSpeed", t0)
        print(deepspeed_table(a))
    if "orders" in parts:
        section("4. bytes per step against micro-batches", t0)
        print(orders_table(a))
    section("done", t0)
    write_rows(a.json, ROWS)
    return 0


PARTS = ("plain", "fp32", "int8", "deepspeed", "orders")


def section(title: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:6.0f} s] {title}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
