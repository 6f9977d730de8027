"""`behemoth serve` against llama.cpp's OpenAI-compatible servers: output tokens/s and time to first token, N clients.

bench_llamacpp's random-weight 25M Llama (8 layers, hidden 512, GQA 8/4, a 2048-piece sentencepiece vocabulary) is
saved with save_pretrained and converted by llama.cpp's own converter to an f32 GGUF. This process then starts, as its
children, `behemoth serve` on the folder and llama.cpp's servers on the GGUF, each on `--threads` threads:

- llama-cpp-python's server (`python -m llama_cpp.server`): one Llama behind a lock, so requests run one at a time
  (it has no parallel slots); `--interrupt_requests False`, or each new request would cut the stream in progress.
- llama.cpp's own C++ server (`llama-server`, given with `--llama-server PATH`, built from the same sdist):
  `--parallel N` slots decoded together (continuous batching), N = the largest level of clients, each slot the context
  of one request.

The official `openai` client (AsyncOpenAI, one event loop) runs N concurrent clients against each, every client
sending its next request when the previous ends: the same prompts (slices of the stdlib's sources, sent as the same
token ids to every server: BOS and the tokenizer's ids, as llama.cpp tokenizes the text; new slices every round, so
that no server prefills a repeated prompt from a cache), greedy, streamed, `max_tokens` fixed and the end-of-sequence
token banned by logit_bias, so every request yields exactly `max_tokens`.
Levels run interleaved (each level: every server in turn, the order reversed every other round), the best of
`--rounds` kept. Per server and level: output tokens/s (all completion tokens over the level's wall time), p50/p99 time
to first token (first streamed chunk), the server's CPU seconds per 1,000 output tokens (steadier than wall time on a
shared machine) and the load average beside it. Run:

    pip install -e '.[serve,llamacpp,llamacpp-server]'
    python benchmarks/bench_serve_llamacpp.py --converter llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py \\
        [--llama-server build/bin/llama-server] [--baseline DIR]

`--weights int4` serves 4-bit weights instead: behemoth with `--quantize int4` (symmetric, a scale per 64 inputs) and
llama.cpp with the GGUF that its own `llama-quantize` (`--llama-quantize PATH`, default beside `--llama-server`) writes
as Q4_0 (symmetric, a scale per 32 inputs) from the f32 one.

`--baseline DIR` also serves behemoth from another source tree (`git archive <commit> | tar -x -C DIR`, run with
PYTHONPATH=DIR) beside this one: a change's before and after in one run, on the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import random
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ratios import failure, ratio, write_rows  # noqa: E402

from behemoth.faults.launch import free_port  # noqa: E402
from benchmarks.bench_inference import save_llama  # noqa: E402
from benchmarks.bench_llamacpp import SHAPE, save_tokenizer, to_gguf  # noqa: E402

LEVELS = (1, 8, 32)
BEHEMOTH = "behemoth serve"
LLAMA_PY = "llama-cpp-python server"
LLAMA_CPP = "llama.cpp llama-server"
BASELINE = "behemoth serve (baseline)"


def server_commands(folder: str, gguf: str, args: argparse.Namespace) -> dict[str, list[str]]:
    """Each server's command line, with a `{port}` to fill; each given its best settings for N concurrent clients."""
    top = max(args.levels)
    ctx = args.prompt_tokens + args.max_tokens + 64  # one request's context
    cmds = {
        BEHEMOTH: [sys.executable, "-m", "behemoth", "serve", folder, "--port", "{port}", "--model-name", "llama"]
        + ["--max-batch", str(top), "--max-waiting", "4096", "--max-streams", str(4 * top), "--kv-cache-mb", "512"]
        + (["--quantize", "int4"] if args.weights == "int4" else []),
    }
    if args.baseline:  # the same server from another source tree (an earlier commit), to measure a change in one run
        cmds[BASELINE] = ["env", f"PYTHONPATH={args.baseline}", *cmds[BEHEMOTH]]
    if importlib.util.find_spec("llama_cpp") is not None and not args.no_llama_cpp_python:
        cmds[LLAMA_PY] = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--port", "{port}", "--model_alias", "llama"]
        cmds[LLAMA_PY] += ["--n_threads", str(args.threads), "--n_threads_batch", str(args.threads), "--n_ctx", str(ctx), "--n_batch", "512"]
        cmds[LLAMA_PY] += ["--interrupt_requests", "False", "--verbose", "False"]
    else:
        print("llama-cpp-python's server: skipped (not installed, or --no-llama-cpp-python)", flush=True)
    if args.llama_server:
        cmds[LLAMA_CPP] = [args.llama_server, "-m", gguf, "--port", "{port}", "--alias", "llama", "-t", str(args.threads)]
        cmds[LLAMA_CPP] += ["-tb", str(args.threads), "--parallel", str(top), "-c", str(ctx * top), "--cont-batching", "-b", "512"]
        cmds[LLAMA_CPP] += ["--no-webui"]
    return cmds


def q4_gguf(f32: str, args: argparse.Namespace) -> str:
    """The f32 GGUF quantized to Q4_0 by llama.cpp's own llama-quantize; its path."""
    tool = args.llama_quantize or (str(Path(args.llama_server).parent / "llama-quantize") if args.llama_server else None)
    if tool is None or not Path(tool).exists():
        raise SystemExit("--weights int4 needs llama.cpp's llama-quantize: --llama-quantize PATH (cmake --build build --target llama-quantize)")
    out = f32.replace("-f32.gguf", "-q4_0.gguf")
    subprocess.run([tool, f32, out, "Q4_0"], check=True, capture_output=True)
    return out


def start_server(cmd: list[str], threads: int) -> tuple[subprocess.Popen, str]:
    """Start one server (a child of this process) and wait until it lists its model."""
    import httpx

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    # the server's log goes to a file: a pipe nobody reads fills up, and a server that logs every request then blocks
    log = tempfile.NamedTemporaryFile("w+", prefix=f"{Path(cmd[0]).name}-", suffix=".log", delete=False)
    proc = subprocess.Popen([c.replace("{port}", str(port)) for c in cmd], env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited: {Path(log.name).read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"{cmd[0]} did not start within 300 s")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a server process and its children so far."""
    import psutil

    proc = psutil.Process(pid)
    return sum(p.cpu_times().user + p.cpu_times().system for p in [proc, *proc.children(recursive=True)])


def make_prompts(n: int, chars: int, seed: int = 0) -> list[str]:
    """`n` slices of `chars` characters of the stdlib's sources (the text the tokenizer was trained on)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng, out = random.Random(seed), []
    while len(out) < n:
        text = rng.choice(files).read_text(errors="ignore")
        if len(text) > 2 * chars:
            start = rng.randrange(len(text) - chars)
            out.append(text[start : start + chars])
    return out


async def one_request(client: Any, prompt: str | list[int], args: argparse.Namespace) -> dict[str, Any]:
    """One streamed greedy completion: its latency, time to first chunk, output tokens and text."""
    t0 = time.perf_counter()
    first, parts, finish, usage = None, [], None, None
    stream = await client.completions.create(
        model="llama",
        prompt=prompt,
        max_tokens=args.max_tokens,
        temperature=0.0,
        stream=True,
        logit_bias={str(args.eos): -100},
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].text or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    end = time.perf_counter()
    tokens = usage if usage is not None else args.max_tokens if finish == "length" else len(parts)
    return {"latency": end - t0, "ttft": (first or end) - t0, "tokens": tokens, "text": "".join(parts)}


async def run_level(url: str, clients: int, prompts: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    """`clients` concurrent clients share the prompts, each sending its next one when the previous ends."""
    import httpx
    import openai

    queue: asyncio.Queue = asyncio.Queue()
    for i, prompt in enumerate(prompts):
        queue.put_nowait((i, prompt))
    results: dict[int, dict[str, Any]] = {}
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with openai.AsyncOpenAI(
        base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=900, http_client=httpx.AsyncClient(limits=limits, timeout=900)
    ) as client:

        async def worker() -> None:
            while not queue.empty():
                i, prompt = queue.get_nowait()
                results[i] = await one_request(client, prompt, args)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - t0
    rows = [results[i] for i in sorted(results)]
    return {"wall": wall, "tok_s": sum(r["tokens"] for r in rows) / wall, "rows": rows, **ttft_stats([r["ttft"] for r in rows])}


def ttft_stats(ttfts: list[float]) -> dict[str, float]:
    if len(ttfts) < 2:
        return {"ttft50": ttfts[0], "ttft99": ttfts[0]}
    q = statistics.quantiles(ttfts, n=100, method="inclusive")
    return {"ttft50": statistics.median(ttfts), "ttft99": q[98]}


def prompts_for(name: str, texts: list[str], args: argparse.Namespace) -> list[Any]:
    """The prompts as each server is sent them: by default the same token ids to every server, those llama.cpp's
    tokenizer gives the text (a BOS, then what transformers' tokenizer gives it: the folder's tokenizer adds no BOS), so
    that both prefill the same tokens and greedy texts can be compared; with `--text`, the text itself to every server
    (each then tokenizes it its own way: llama.cpp with a BOS first, behemoth as transformers does, without)."""
    if args.text:
        return texts
    return [[args.tokenizer.bos_token_id, *args.tokenizer(t, add_special_tokens=False).input_ids] for t in texts]


def measure(name: str, proc: subprocess.Popen, url: str, clients: int, args: argparse.Namespace, round_: int = 0) -> dict[str, Any]:
    """One level on one server, with the server's CPU seconds and the machine's load average. Every round's prompts
    are new (a server that keeps a prompt's KV cache, as llama-server's slots do, would otherwise prefill a repeated
    round's prompts from its cache); every server gets the same ones."""
    texts = make_prompts(max(clients * args.per_client, args.min_requests), args.prompt_chars, seed=1000 * round_ + clients)
    prompts = prompts_for(name, texts, args)
    c0 = cpu_seconds(proc.pid)
    got = asyncio.run(run_level(url, clients, prompts, args))
    tokens = sum(r["tokens"] for r in got["rows"])
    got |= {"server": name, "clients": clients, "requests": len(prompts), "tokens": tokens, "load": os.getloadavg()[0]}
    got["cpu_per_1k"] = (cpu_seconds(proc.pid) - c0) / tokens * 1e3
    print(
        f"  {name} @ {clients}: {got['tok_s']:.0f} tok/s, TTFT p50 {got['ttft50']:.3f} s p99 {got['ttft99']:.3f} s, "
        f"{got['cpu_per_1k']:.1f} CPU s/1k tokens, load {got['load']:.2f}",
        flush=True,
    )
    return got


def measure_again_once(name: str, server: tuple[subprocess.Popen, str], clients: int, args: argparse.Namespace, round_: int) -> dict[str, Any]:
    """`measure`, repeated when a request of the level fails on a connection error (llama-server, given token ids, now
    and then closes a connection without an answer while its process runs on), up to `RETRIES` times; each failure is
    printed, and one more ends the run. Each repeat gets prompts of its own: a failed attempt's would be in the server's
    prompt cache (llama-server then answered a repeated 32-client level at 1,375 tok/s against 890-910 for new prompts)."""
    import openai

    for attempt in range(RETRIES + 1):
        try:
            return measure(name, *server, clients, args, round_ + 100 * attempt)
        except openai.APIConnectionError as err:
            if attempt == RETRIES:
                raise
            print(
                f"  {name} @ {clients}: a request failed ({err.__class__.__name__}: {err.__cause__!r}); the level runs again on new prompts",
                flush=True,
            )
    raise AssertionError("unreachable")


RETRIES = 3  # a level measured again at most this many times after a dropped connection


def run_all(servers: dict[str, tuple[subprocess.Popen, str]], args: argparse.Namespace) -> dict[tuple[str, int], dict[str, Any]]:
    """Every level on every server, interleaved, `args.rounds` rounds; the fastest round of each kept."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for name, (_, url) in servers.items():  # warm-up: behemoth's first decode steps compile, llama.cpp's pages in
        asyncio.run(run_level(url, 2, prompts_for(name, make_prompts(4, args.prompt_chars, seed=99), args), args))
    for r in range(args.rounds):
        for clients in args.levels:
            for name in list(servers) if r % 2 == 0 else list(servers)[::-1]:
                got = measure_again_once(name, servers[name], clients, args, r)
                if (name, clients) in best:
                    got["first_round"] = best[name, clients].get("first_round", best[name, clients])
                if (name, clients) not in best or got["tok_s"] > best[name, clients]["tok_s"]:
                    best[name, clients] = got
    return best


def same_text(a: dict[str, Any], b: dict[str, Any]) -> str:
    """How many of the level's completions two servers wrote alike (greedy on the same weights), in the first round
    (every server was sent the same prompts in it)."""
    a, b = a.get("first_round", a), b.get("first_round", b)
    return f"{sum(x['text'] == y['text'] for x, y in zip(a['rows'], b['rows']))}/{len(a['rows'])}"


def table(best: dict[tuple[str, int], dict[str, Any]], names: list[str], levels: list[int]) -> list[str]:
    peers = [n for n in names if n != BEHEMOTH]
    head = "| server | clients | requests | output tok/s | p50 TTFT s | p99 TTFT s | CPU s / 1k tokens | load | " + " | ".join(
        f"behemoth / {p} tok/s | same text as behemoth" for p in peers
    )
    rows = [head + " |", "|---|" + "---:|" * (7 + 2 * len(peers))]
    for clients in levels:
        ours = best[BEHEMOTH, clients]
        for name in names:
            r = best[name, clients]
            extra = [f"{ours['tok_s'] / best[p, clients]['tok_s']:.2f} | {same_text(r, best[p, clients])}" for p in peers]
            rows.append(
                f"| {name} | {clients} | {r['requests']} | {r['tok_s']:.0f} | {r['ttft50']:.3f} | {r['ttft99']:.3f} | "
                f"{r['cpu_per_1k']:.1f} | {r['load']:.2f} | " + (" | ".join(extra) if name == BEHEMOTH else " | ".join(["-"] * 2 * len(peers))) + " |"
            )
    return rows


def ratio_rows(best: dict[tuple[str, int], dict[str, Any]], names: list[str], levels: list[int], weights: str = "f32") -> list[dict[str, Any]]:
    out = []
    for clients in levels:
        ours, case = best[BEHEMOTH, clients], f"{clients} concurrent clients" + ("" if weights == "f32" else f", {weights} weights")
        for peer in (n for n in names if n != BEHEMOTH):
            theirs = best[peer, clients]
            out += [
                ratio("serving", case, peer, "output tokens/s", ours["tok_s"], theirs["tok_s"]),
                ratio("serving", case, peer, "p99 time to first token", ours["ttft99"], theirs["ttft99"], higher_is_better=False),
                ratio("serving", case, peer, "server CPU s per 1k tokens", ours["cpu_per_1k"], theirs["cpu_per_1k"], higher_is_better=False),
            ]
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--converter", default=os.environ.get("LLAMACPP_CONVERTER"), help="llama.cpp's convert_hf_to_gguf.py")
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (optional)")
    p.add_argument("--levels", type=int, nargs="*", default=list(LEVELS))
    p.add_argument("--threads", type=int, default=2, help="each server's threads (default 2)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--prompt-chars", type=int, default=256, help="characters per prompt (default 256)")
    p.add_argument("--per-client", type=int, default=2, help="requests per client per level (default 2)")
    p.add_argument("--min-requests", type=int, default=8, help="requests per level at least (default 8)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--text", action="store_true", help="send every server the prompts' text (default: the same token ids)")
    p.add_argument("--baseline", default=None, help="also serve behemoth from this source tree (e.g. `git archive` of a commit)")
    p.add_argument("--no-llama-cpp-python", action="store_true", help="leave out llama-cpp-python's server")
    p.add_argument("--weights", choices=["f32", "int4"], default="f32", help="f32, or 4-bit: behemoth int4 against llama.cpp's Q4_0")
    p.add_argument("--llama-quantize", default=None, help="llama.cpp's llama-quantize binary (default: beside --llama-server)")
    p.add_argument("--quick", action="store_true", help="16 output tokens, levels 1 and 8")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.quick:
        args.max_tokens, args.levels = 16, [1, 8]
    args.prompt_tokens = args.prompt_chars  # at most a token per character (byte fallback): the context to reserve
    return args


def main() -> int:
    args = parse_args()
    if not args.converter or not Path(args.converter).exists():
        print("bench_serve_llamacpp needs llama.cpp's converter: --converter .../convert_hf_to_gguf.py (or LLAMACPP_CONVERTER)")
        write_rows(args.json, [failure("serving", LLAMA_PY, "no --converter given (llama.cpp's convert_hf_to_gguf.py)")])
        return 0
    with tempfile.TemporaryDirectory(prefix="behemoth-bench-serve-llamacpp-") as root:
        folder, gguf = str(Path(root) / "llama"), str(Path(root) / "llama-f32.gguf")
        params = save_llama(SHAPE, folder)
        save_tokenizer(folder, SHAPE["vocab_size"])
        to_gguf(args.converter, folder, gguf)
        if args.weights == "int4":
            gguf = q4_gguf(gguf, args)
        from transformers import AutoTokenizer

        args.tokenizer = AutoTokenizer.from_pretrained(folder)
        args.eos = args.tokenizer.eos_token_id
        cmds = server_commands(folder, gguf, args)
        servers = {name: start_server(cmd, args.threads) for name, cmd in cmds.items()}
        try:
            best = run_all(servers, args)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=30)
    names = list(cmds)
    weights = "float32" if args.weights == "f32" else "4-bit weights (behemoth int4, llama.cpp Q4_0)"
    print(f"\nLlama {params / 1e6:.1f}M parameters, {weights}, every server on {args.threads} threads; prompts of {args.prompt_chars} characters")
    print(f"of the stdlib's sources, {args.max_tokens} greedy output tokens each, streamed; best of {args.rounds} round(s).\n")
    print("\n".join(table(best, names, args.levels)))
    print("\n" + "\n".join(f"{name}: {' '.join(cmd)}" for name, cmd in cmds.items()))
    write_rows(args.json, ratio_rows(best, names, args.levels, args.weights))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
