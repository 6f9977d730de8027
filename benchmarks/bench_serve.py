"""`behemoth serve` under load: continuous batching vs static batching of the same server, N concurrent clients.

The server (`python -m behemoth serve`, a separate process) serves a random-weight Llama saved as a local
folder; an asyncio client (httpx) runs N concurrent clients, each sending streamed completions back to back
with varied prompt lengths and output lengths (greedy, drawn from a fixed seed so both batching modes see the
same requests). Per level: output tokens/s (all completion tokens / wall time), requests/s, p50 and p99
latency and time to first token (first streamed chunk), and errors (target 0). Run:

    python benchmarks/bench_serve.py            # N = 1, 8, 32, 128 (a quiet machine, several minutes)
    python benchmarks/bench_serve.py --quick    # a small model, short requests: a minute or two

Peer serving engines: vLLM 0.33.0 (the current wheel) requires torch==2.14.0 exactly, while behemoth pins
torch 2.13.0, and its wheel is built for CUDA GPUs (FlashMLA, FlashInfer, NVIDIA libraries); its CPU backend
must be built from source. So it neither installs beside behemoth nor runs on this CPU-only machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ratios import write_rows  # noqa: E402

from behemoth.faults.launch import free_port  # noqa: E402
from benchmarks.llama_models import SHAPES, save_llama  # noqa: E402

LEVELS = (1, 8, 32, 128)


def start_server(folder: str, batching: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "behemoth",
        "serve",
        folder,
        "--port",
        str(port),
        "--batching",
        batching,
        "--max-batch",
        str(args.max_batch),
        "--max-waiting",
        "4096",
        "--max-tokens",
        "512",
        "--kv-cache-mb",
        str(args.kv_cache_mb),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the server did not start within 120 s")


def workload(n: int, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    """`n` requests with prompt and output lengths drawn uniformly from the ranges, greedy."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz      "
    return [
        {
            "prompt": "".join(rng.choice(letters) for _ in range(rng.randint(*args.prompt_chars))),
            "max_tokens": rng.randint(*args.output_tokens),
            "temperature": 0,
            "stream": True,
        }
        for _ in range(n)
    ]


async def one_request(client: Any, body: dict[str, Any]) -> dict[str, Any]:
    """Latency, time to first streamed chunk, completion tokens, or the error."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                first = first or time.perf_counter()
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    except Exception as err:  # a refused or broken connection counts as an error of the level
        return {"error": type(err).__name__}
    end = time.perf_counter()
    return {"latency": end - t0, "ttft": (first or end) - t0, "tokens": tokens}


async def run_level(url: str, clients: int, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """`clients` concurrent clients share the requests, each sending its next one when the previous ends."""
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for body in requests:
        queue.put_nowait(body)
    results: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                results.append(await one_request(client, queue.get_nowait()))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    pct = lambda xs, q: statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else (xs[0] if xs else float("nan"))  # noqa: E731
    return {
        "clients": clients,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "wall": wall,
        "tok_s": sum(r["tokens"] for r in ok) / wall,
        "req_s": len(ok) / wall,
        "p50": pct([r["latency"] for r in ok], 50),
        "p99": pct([r["latency"] for r in ok], 99),
        "ttft50": pct([r["ttft"] for r in ok], 50),
        "ttft99": pct([r["ttft"] for r in ok], 99),
    }


def measure(folder: str, batching: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    proc, url = start_server(folder, batching, args)
    try:
        asyncio.run(run_level(url, 2, workload(4, args, seed=99)))  # warm-up
        return [asyncio.run(run_level(url, n, workload(max(n * args.per_client, 8), args, seed=n))) for n in args.levels]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def ratio_rows(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """`behemoth bench` rows: continuous batching against the same server's static batching, per level of clients."""
    from ratios import ratio

    out = []
    for r, other in zip(results["continuous"], results["static"]):
        case = f"{r['clients']} concurrent clients"
        out += [
            ratio("serving", case, "static batching", "output tokens/s", r["tok_s"], other["tok_s"]),
            ratio("serving", case, "static batching", "p99 time to first token", r["ttft99"], other["ttft99"], higher_is_better=False),
        ]
    return out


def table(results: dict[str, list[dict[str, Any]]]) -> list[str]:
    rows = [
        "| batching | clients | requests | output tok/s | req/s | p50 latency s | p99 latency s | p50 TTFT s | p99 TTFT s | errors |"
        " continuous / static tok/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in ("continuous", "static"):
        for r, other in zip(results[mode], results["static"]):
            ratio = f"{r['tok_s'] / other['tok_s']:.2f}" if mode == "continuous" else "-"
            rows.append(
                f"| {mode} | {r['clients']} | {r['requests']} | {r['tok_s']:.0f} | {r['req_s']:.2f} | {r['p50']:.2f} | "
                f"{r['p99']:.2f} | {r['ttft50']:.3f} | {r['ttft99']:.3f} | {r['errors']} | {ratio} |"
            )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model and short requests (a minute or two)")
    p.add_argument("--levels", type=int, nargs="*", default=list(LEVELS), help="concurrent clients per level (default 1 8 32 128)")
    p.add_argument("--threads", type=int, default=2, help="the server's intra-op threads (default 2)")
    p.add_argument("--max-batch", type=int, default=64, help="the server's running batch (default 64)")
    p.add_argument("--kv-cache-mb", type=float, default=512.0, help="the server's KV cache (default 512 MiB)")
    p.add_argument("--json", metavar="FILE", help="also write the ratio rows to FILE (for `behemoth bench`)")
    args = p.parse_args()
    args.prompt_chars = (8, 48) if args.quick else (16, 256)
    args.output_tokens = (4, 24) if args.quick else (16, 128)
    args.per_client = 1 if args.quick else 4
    try:
        import httpx  # noqa: F401
    except ImportError:
        print("bench_serve needs httpx and the serving stack: pip install -e '.[test,hf]'")
        return 2
    folder = tempfile.mkdtemp(prefix="behemoth-bench-serve-")
    try:
        shape = SHAPES["quick" if args.quick else "full"]
        params = save_llama(shape, folder)
        results = {mode: measure(folder, mode, args) for mode in ("continuous", "static")}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"## Serving under load ({'quick' if args.quick else 'full'} run)\n")
    print(
        f"Llama {params / 1e6:.1f}M parameters, float32, server with {args.threads} thread(s), max batch {args.max_batch}; "
        f"prompts {args.prompt_chars[0]}-{args.prompt_chars[1]} characters (byte tokens), outputs {args.output_tokens[0]}-"
        f"{args.output_tokens[1]} tokens, greedy, streamed; {args.per_client} request(s) per client per level (at least 8).\n"
    )
    print("\n".join(table(results)))
    write_rows(args.json, ratio_rows(results))
    print("\nvLLM: not run. " + __doc__.split("Peer serving engines: ")[1].strip().replace("\n", " "))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
