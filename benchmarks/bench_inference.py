"""behemoth generation vs transformers' `generate`; tensor-parallel vs one process; offloaded vs in-memory.

One Llama built from a config with random weights is saved as a local folder; behemoth and transformers
load that same folder, so both generate from the same weights and prompts (greedy; the token sequences are
compared and the table says whether they agree). Run:

    python benchmarks/bench_inference.py            # the full run (a quiet machine, several minutes)
    python benchmarks/bench_inference.py --quick    # a small model, fewer tokens: a minute or two

1. Generation, one process: tokens/s (batch x new tokens / wall time of the whole generation) and time to
   first token (behemoth: from submission to the first sampled token; transformers: a `generate` of one new
   token) at batch 1 and 16, same-length prompts (no padding on either side), best of `--rounds`.
2. Tensor parallelism: the same generation on 2 processes (tp=2, one thread each) vs one process with one and
   with two threads.
3. int8 weight-only: a small GPT trained here, float32 vs int8: validation loss and its change, bytes of the
   linear weights, generation tokens/s, greedy tokens equal to float32's.
4. Offload: under a memory budget (`--memory-gb`), the largest model of a ladder of depths whose weights and
   KV cache fit in memory, and the largest that generates with its blocks streamed from disk (resident parts +
   two blocks + KV cache within the budget; its folder needs free disk space, checked first and removed after).
   Both generate; measured: tokens/s, seconds per forward, and the bound (streamed bytes / the disk's measured
   sequential read bandwidth with the page cache dropped), peak bytes of blocks held, peak RSS.
5. Memory: a random GPT-2 124M save_pretrained folder; the peak resident memory (the kernel's ru_maxrss of each child
   process) of `behemoth generate` (float32, int8, blocks offloaded to disk) and of transformers' from_pretrained + generate, the same prompt
   and tokens, each in a child process of this one; PYTHONPATH passes to them, so `PYTHONPATH=/path/to/other/tree`
   measures another version of behemoth (the parent only saves the folder).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ratios import ratio, write_rows

ROWS: list[dict[str, Any]] = []  # the comparisons with transformers, for `behemoth bench` (--json)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.llama_models import SHAPES, llama_options, make_prompts, save_llama  # noqa: E402


def ours_vs_transformers(folder: str, batch: int, prompt_len: int, new: int, rounds: int) -> dict[str, Any]:
    """One process: behemoth's and transformers' greedy generation of the same prompts, best of `rounds` each."""
    import torch
    import transformers

    from behemoth.inference import SamplingParams, load

    gen = load(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="sdpa").eval()
    prompts = make_prompts(batch, prompt_len, hf.config.vocab_size)
    ids = torch.tensor(prompts)
    gen.generate(prompts, SamplingParams(max_tokens=2), ignore_eos=True)  # warm-up, untimed, both sides
    with torch.no_grad():
        hf.generate(input_ids=ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    best: dict[str, float] = {}
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = gen.generate(prompts, SamplingParams(max_tokens=new), ignore_eos=True)
        best["ours_s"] = min(best.get("ours_s", 1e9), time.perf_counter() - t0)
        best["ours_ttft"] = min(best.get("ours_ttft", 1e9), statistics.median(c.time_to_first_token_s for c in out))
        with torch.no_grad():
            t0 = time.perf_counter()
            ref = hf.generate(input_ids=ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            best["hf_s"] = min(best.get("hf_s", 1e9), time.perf_counter() - t0)
            t0 = time.perf_counter()
            hf.generate(input_ids=ids, max_new_tokens=1, do_sample=False, pad_token_id=0)
            best["hf_ttft"] = min(best.get("hf_ttft", 1e9), time.perf_counter() - t0)
    same = [c.tokens for c in out] == ref[:, prompt_len:].tolist()
    return {**best, "tokens": batch * new, "same": same}


def generation_table(folder: str, args: argparse.Namespace) -> list[str]:
    from behemoth.faults.ranks import run_ranks

    rows = [
        "| batch | prompt + new tokens | behemoth tok/s | transformers tok/s | ratio | behemoth TTFT ms | transformers TTFT ms | same tokens |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for batch in (1, 16):
        r = run_ranks(1, ours_vs_transformers, folder, batch, args.prompt_len, args.new_tokens, args.rounds, threads=args.threads, timeout=3600)[0]
        ours, theirs = r["tokens"] / r["ours_s"], r["tokens"] / r["hf_s"]
        case = f"batch {batch}, {args.prompt_len} + {args.new_tokens} tokens"
        ROWS.extend(
            [
                ratio("inference", case, "transformers generate", "tokens/s", ours, theirs),
                ratio("inference", case, "transformers generate", "time to first token", r["ours_ttft"], r["hf_ttft"], higher_is_better=False),
            ]
        )
        rows.append(
            f"| {batch} | {args.prompt_len} + {args.new_tokens} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f} | "
            f"{1000 * r['ours_ttft']:.1f} | {1000 * r['hf_ttft']:.1f} | {'yes' if r['same'] else 'NO'} |"
        )
    return rows


def timed_generation(folder: str, batch: int, prompt_len: int, new: int, tp: int, rounds: int) -> dict[str, Any] | None:
    """One rank of a tp-way generation job; rank 0 returns the best wall time and the tokens."""
    from behemoth.inference import SamplingParams
    from behemoth.inference.generate import CachePolicy, follow_model, generator_for
    from behemoth.inference.loading import load_model, resolve_source
    from behemoth.topology import init_runtime

    source = resolve_source(folder)
    rt = init_runtime(tp=tp)
    model = load_model(source, rt, tp=tp)
    if rt.rank != 0:
        follow_model(model, CachePolicy())
        return None
    gen = generator_for(model, source, CachePolicy())
    prompts = make_prompts(batch, prompt_len, model.lm.shape.vocab_size)
    gen.generate(prompts, SamplingParams(max_tokens=2), ignore_eos=True)  # warm-up, untimed
    best = 1e9
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = gen.generate(prompts, SamplingParams(max_tokens=new), ignore_eos=True)
        best = min(best, time.perf_counter() - t0)
    gen.close()
    return {"s": best, "tokens": [c.tokens for c in out]}


def tensor_parallel_table(folder: str, args: argparse.Namespace) -> list[str]:
    from behemoth.faults.ranks import run_ranks

    rows = ["| batch | layout | tok/s | vs one process, 1 thread | same tokens |", "|---:|---|---:|---:|---|"]
    for batch in (1, 16):
        call = (folder, batch, args.prompt_len, args.new_tokens)
        one = run_ranks(1, timed_generation, *call, 1, args.rounds, threads=1, timeout=3600)[0]
        two_threads = run_ranks(1, timed_generation, *call, 1, args.rounds, threads=2, timeout=3600)[0]
        tp2 = run_ranks(2, timed_generation, *call, 2, args.rounds, threads=1, timeout=3600)[0]
        tokens = batch * args.new_tokens
        for name, r in (("1 process, 1 thread", one), ("1 process, 2 threads", two_threads), ("tp=2, 2 processes x 1 thread", tp2)):
            rows.append(f"| {batch} | {name} | {tokens / r['s']:.0f} | {one['s'] / r['s']:.2f} | {'yes' if r['tokens'] == one['tokens'] else 'NO'} |")
    return rows


OFFLOAD_WIDTH = {  # the ladder's width; its depth is what varies
    "quick": dict(d_model=256, n_head=8, kv_heads=4, ffn=688, vocab_size=2048, context=256),
    "full": dict(d_model=2048, n_head=16, kv_heads=8, ffn=5504, vocab_size=32000, context=512),
}


def ladder_bytes(width: dict[str, int]) -> tuple[int, int]:
    """(float32 bytes of one block, of the resident parts: embedding, head, final norm) of the ladder's Llama."""
    from behemoth.config import load_config
    from behemoth.models.causal_lm import build_causal_lm

    cfg = load_config(None, llama_options({**width, "n_layer": 1}))
    lm = build_causal_lm(cfg.model, cfg.hf)
    block = sum(p.numel() * 4 for n, p in lm.module.named_parameters() if n.startswith("model.layers."))
    return block, sum(p.numel() * 4 for p in lm.module.parameters()) - block


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def disk_bandwidth(model: Any) -> float:
    """Bytes/s of fetching every block from its file with the page cache dropped first (the read offload does)."""
    stores = [s for s in model.stores if s.spec.role == "block"]
    for s in stores:
        drop_page_cache(s.tiers.params.path(s.p_key))
    t0 = time.perf_counter()
    total = sum(s.tiers.params.fetch(s.p_key).numel() * 4 for s in stores)
    return total / (time.perf_counter() - t0)


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to forget a file's cached pages (so the next read comes from the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # written pages must be on the disk before they can be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run_ladder_model(width: dict[str, int], layers: int, folder: str | None, new: int, batches: tuple[int, ...], kv_mb: int) -> dict[str, Any]:
    """Generate with a `layers`-deep model in memory (folder None) or with its blocks streamed from `folder`."""
    import resource

    from behemoth.config import load_config
    from behemoth.inference import CachePolicy, SamplingParams, load
    from behemoth.inference.generate import offloaded_generator
    from behemoth.inference.loading import Source
    from behemoth.inference.offload import generation_policy

    base = rss_bytes()
    source = Source(load_config(None, llama_options({**width, "n_layer": layers})), None, None)
    cache = CachePolicy(memory_mb=kv_mb)
    t0 = time.perf_counter()
    off = offloaded_generator(source, generation_policy("disk", folder, prefetch=1), cache) if folder else None
    gen = off.generator if off else load(source, cache=cache)
    out: dict[str, Any] = {"build_s": time.perf_counter() - t0, "runs": []}
    for batch in batches:
        prompts = make_prompts(batch, 16, width["vocab_size"])
        t0 = time.perf_counter()
        gen.generate(prompts, SamplingParams(max_tokens=new), ignore_eos=True)
        out["runs"].append({"batch": batch, "s": time.perf_counter() - t0, "forwards": gen.stats["steps"]})
    if off:
        out.update(streamed=off.streamed_bytes, peak_held=off.stats.peak_held, bandwidth=disk_bandwidth(off.model))
        off.close()
    out["rss_growth"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return out


def offload_table(args: argparse.Namespace) -> list[str]:
    from behemoth.faults.ranks import run_ranks

    width = OFFLOAD_WIDTH["quick" if args.quick else "full"]
    block, resident = ladder_bytes(width)
    budget, kv = int(args.memory_gb * 2**30), args.kv_mb * 2**20
    fit = (budget - resident - kv) // block
    if fit < 1 or resident + 2 * block + kv > budget:
        return [f"(--memory-gb {args.memory_gb} holds no model of this ladder: a block is {block / 2**20:.0f} MiB)"]
    free = shutil.disk_usage(tempfile.gettempdir()).free
    disk_limit = int(min(free * 0.5, args.max_disk_gb * 2**30)) // block
    run = min(disk_limit, 2 * fit)
    need = run * block
    if need > free * 0.5:
        return [f"(offload needs {need / 2**30:.1f} GiB free on {tempfile.gettempdir()}, {free / 2**30:.1f} GiB are)"]
    print(f"offload: writing {need / 2**30:.2f} GiB of blocks to {tempfile.gettempdir()} (removed after)", flush=True)
    folder = tempfile.mkdtemp(prefix="behemoth-bench-offload-")
    try:
        batches = (1, 16)
        mem = run_ranks(1, run_ladder_model, width, fit, None, args.offload_tokens, batches, args.kv_mb, threads=args.threads, timeout=7200)[0]
        off = run_ranks(1, run_ladder_model, width, run, folder, args.offload_tokens, batches, args.kv_mb, threads=args.threads, timeout=7200)[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    gb = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    rows = [
        f"Memory budget {args.memory_gb} GiB; a block is {block / 2**20:.1f} MiB, the resident parts {resident / 2**20:.1f} MiB, "
        f"the KV cache {args.kv_mb} MiB. Largest that fits in memory: {fit} blocks ({gb(resident + fit * block)} GiB). "
        f"Largest that generates offloaded from disk: {disk_limit} blocks ({gb(resident + disk_limit * block)} GiB, bounded by disk "
        f"space, not memory); measured at {run} blocks. Disk read bandwidth (page cache dropped): {off['bandwidth'] / 2**30:.2f} GiB/s.",
        "",
        "| model | weights GiB | batch | tok/s | s per forward | bound: streamed bytes / disk bandwidth (s) | "
        "peak blocks held MiB | peak RSS growth MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r, layers in (("in memory", mem, fit), ("offloaded (disk)", off, run)):
        for x in r["runs"]:
            bound = f"{off['streamed'] / off['bandwidth']:.3f}" if r is off else "-"
            held = f"{off['peak_held'] / 2**20:.0f}" if r is off else "-"
            rows.append(
                f"| {name}, {layers} blocks | {gb(resident + layers * block)} | {x['batch']} | "
                f"{x['batch'] * args.offload_tokens / x['s']:.1f} | {x['s'] / x['forwards']:.3f} | {bound} | {held} | "
                f"{r['rss_growth'] / 2**20:.0f} |"
            )
    return rows


def int8_vs_float(run: str, batch: int, new: int) -> dict[str, Any]:
    """Validation loss, linear-weight bytes, generation tokens/s and greedy agreement of a checkpoint, float32 vs int8."""
    from behemoth.inference import SamplingParams
    from behemoth.inference.generate import CachePolicy, generator_for
    from behemoth.inference.loading import load_model, resolve_source
    from behemoth.inference.quantize import quantize_int8, validation_loss
    from behemoth.topology import init_runtime

    source, rt = resolve_source(run), init_runtime()
    out: dict[str, Any] = {}
    for kind in ("float32", "int8"):
        model = load_model(source, rt)
        stats = quantize_int8(model.module, transposed=model.lm.transposed) if kind == "int8" else None
        loss = validation_loss(model, source.config, batches=8)
        gen = generator_for(model, source, CachePolicy())
        prompt_len = min(32, gen.context // 2)
        new = min(new, gen.context - prompt_len)
        prompts = make_prompts(batch, prompt_len, model.lm.shape.vocab_size)
        gen.generate(prompts, SamplingParams(max_tokens=2))
        t0 = time.perf_counter()
        tokens = [c.tokens for c in gen.generate(prompts, SamplingParams(max_tokens=new))]
        out[kind] = {"loss": loss, "tok_s": batch * new / (time.perf_counter() - t0), "tokens": tokens, "stats": stats}
    same = [sum(a == b for a, b in zip(x, y)) / len(x) for x, y in zip(out["float32"]["tokens"], out["int8"]["tokens"])]
    out["agreement"], out["shape"] = statistics.mean(same), (prompt_len, new)
    return out


def int8_table(args: argparse.Namespace) -> list[str]:
    """Train a small GPT (so its validation loss means something), then compare float32 and int8 weights."""
    import subprocess

    from behemoth.faults.ranks import run_ranks

    steps, model = (30, "gpt-tiny") if args.quick else (300, "gpt-1m")
    with tempfile.TemporaryDirectory(prefix="behemoth-bench-int8-") as run:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "behemoth",
                "train",
                "--nproc",
                "1",
                f"model={model}",
                f"train.steps={steps}",
                f"checkpoint.every={steps}",
                f"run.dir={run}",
                "run.progress=false",
            ],
            check=True,
            capture_output=True,
        )
        r = run_ranks(1, int8_vs_float, run, 16, args.new_tokens, threads=args.threads, timeout=3600)[0]
    st = r["int8"]["stats"]
    f, q = r["float32"], r["int8"]
    return [
        f"{model} trained {steps} steps on the default corpus; validation loss over 8 batches of 8 x seq_len tokens; "
        f"generation: batch 16, {r['shape'][0]} + {r['shape'][1]} tokens, greedy.",
        "",
        "| weights | linear-weight MiB | validation loss | change | tok/s | greedy tokens equal to float32 |",
        "|---|---:|---:|---:|---:|---:|",
        f"| float32 | {st.float_bytes / 2**20:.2f} | {f['loss']:.4f} | - | {f['tok_s']:.0f} | - |",
        f"| int8 (per-channel) | {st.int8_bytes / 2**20:.2f} | {q['loss']:.4f} | {100 * (q['loss'] - f['loss']) / f['loss']:+.2f}% | "
        f"{q['tok_s']:.0f} | {100 * r['agreement']:.0f}% |",
    ]


MEMORY_CHILD = {  # what each child process of the memory comparison runs; it prints its tokens, then its resident memory
    "transformers": """
import json, sys, torch, transformers
folder, ids, new = sys.argv[1], [int(t) for t in sys.argv[2].split(",")], int(sys.argv[3])
model = transformers.AutoModelForCausalLM.from_pretrained(folder)
with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
print(json.dumps(out[0, len(ids):].tolist()))
""",
    "behemoth": """
import json, sys
from behemoth.cli import main
folder, ids, new, *rest = sys.argv[1:]
main(["generate", folder, "--prompt-ids", ids, "--max-tokens", new, "--ignore-eos", "--json", *rest])
""",
    "imports": "import torch, transformers; transformers.GPT2LMHeadModel",
    "loaded": """
import sys
from behemoth.inference.loading import load_model, resolve_source
from behemoth.topology import init_runtime
model = load_model(resolve_source(sys.argv[1]), init_runtime(), quantize=(sys.argv[2:] or [None])[0])  # alive at the end
""",
}
RSS_AT_END = "\nprint('RSS', open('/proc/self/statm').read().split()[1])"


def save_gpt2(folder: str, quick: bool) -> int:
    """A random-weight GPT-2 (124M; quick: a 4-layer, 256-wide one) saved with save_pretrained; its weight bytes."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4) if quick else transformers.GPT2Config()
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(folder)
    return sum(p.numel() * p.element_size() for p in model.parameters())


LAUNCHER = """
import resource, subprocess, sys
out = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
print(out.stdout + f"MAXRSS {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss} {out.returncode}")
"""


def peak_of_child(kind: str, argv: list[str]) -> dict[str, Any]:
    """Run one child; its peak resident memory (ru_maxrss), its resident memory at the end, and its tokens. A small
    launcher process starts it: a child counts the resident memory of the process it was forked from into its
    ru_maxrss, which must not be this one's. PYTHONPATH passes to the child (PYTHONPATH=/work/main: main's code)."""
    import json
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(Path(__file__).resolve().parent.parent)}
    code = MEMORY_CHILD[kind] + RSS_AT_END
    out = (
        subprocess.run([sys.executable, "-c", LAUNCHER, sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, env=env, text=True, check=True)
        .stdout.strip()
        .splitlines()
    )
    maxrss, status = map(int, out[-1].split()[1:])
    if status != 0:
        raise RuntimeError(f"the {kind} child failed (status {status}); run it alone to see why")
    tokens = [json.loads(line)["tokens"] if line.startswith("{") else json.loads(line) for line in out if line[:1] in "[{"]
    end = int(out[-2].split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return {"peak": maxrss * 1024, "end": end, "tokens": tokens[0] if tokens else None}


def memory_table(args: argparse.Namespace) -> list[str]:
    """Peak resident memory of `behemoth generate` (float32, int8) vs transformers' from_pretrained + generate."""
    with tempfile.TemporaryDirectory(prefix="behemoth-bench-memory-") as folder:
        weights = save_gpt2(folder, args.quick)
        ids, new = ",".join(str(1 + i) for i in range(8)), str(args.new_tokens)
        runs = {
            "python + torch + transformers imported": peak_of_child("imports", []),
            "transformers from_pretrained + generate": peak_of_child("transformers", [folder, ids, new]),
            "behemoth generate": peak_of_child("behemoth", [folder, ids, new]),
            "behemoth generate --quantize int8": peak_of_child("behemoth", [folder, ids, new, "--quantize", "int8"]),
            "behemoth generate --offload disk": peak_of_child("behemoth", [folder, ids, new, "--offload", "disk"]),
            "behemoth load_model, float32": peak_of_child("loaded", [folder]),
            "behemoth load_model, int8": peak_of_child("loaded", [folder, "int8"]),
        }
    peer = runs["transformers from_pretrained + generate"]
    mb = lambda n: f"{n / 2**20:.0f}"  # noqa: E731
    rows = [
        f"GPT-2 ({weights / 2**20:.0f} MiB of float32 weights, random, save_pretrained), prompt of 8 tokens + {new} greedy "
        f"tokens, one process each; peak = the child's ru_maxrss; end = its resident memory as it exits (generate has let "
        f"its model go by then; load_model's rows still hold theirs: what the weights keep resident).",
        "",
        "| run | peak RSS MiB | resident at end MiB | peak / transformers | same tokens as transformers |",
        "|---|---:|---:|---:|---|",
    ]
    for name, r in runs.items():
        same = "-" if r["tokens"] is None or name == "transformers from_pretrained + generate" else ("yes" if r["tokens"] == peer["tokens"] else "NO")
        rows.append(f"| {name} | {mb(r['peak'])} | {mb(r['end'])} | {r['peak'] / peer['peak']:.2f} | {same} |")
        if name.startswith("behemoth generate"):
            ROWS.append(
                ratio(
                    "inference",
                    f"{name}, GPT-2 {weights / 2**20:.0f} MiB",
                    "transformers generate",
                    "peak resident memory",
                    r["peak"],
                    peer["peak"],
                    higher_is_better=False,
                )
            )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small model and few tokens (a minute or two)")
    p.add_argument("--rounds", type=int, default=None, help="repetitions, best kept (default 3; quick 1)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads of the one-process runs (default 2; quick 1)")
    p.add_argument("--memory-gb", type=float, default=None, help="memory budget of the offload comparison (default 4; quick 0.1)")
    p.add_argument("--max-disk-gb", type=float, default=40.0, help="disk the offloaded model may take at most (default 40)")
    p.add_argument("--skip", action="append", default=[], choices=["generation", "tp", "offload", "int8", "memory"], help="leave a section out")
    p.add_argument("--json", metavar="FILE", help="also write the ratio rows to FILE (for `behemoth bench`)")
    args = p.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.threads = args.threads or (1 if args.quick else 2)
    args.memory_gb = args.memory_gb or (0.1 if args.quick else 4.0)
    args.kv_mb = 8 if args.quick else 256
    args.prompt_len, args.new_tokens = (32, 16) if args.quick else (128, 64)
    args.offload_tokens = 4 if args.quick else 8
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shape = SHAPES["quick" if args.quick else "full"]
    with tempfile.TemporaryDirectory(prefix="behemoth-bench-inference-") as folder:
        params = save_llama(shape, folder)
        print(f"## Generation: behemoth vs transformers generate ({'quick' if args.quick else 'full'} run)\n")
        print(f"Llama {params / 1e6:.1f}M parameters ({shape}), float32, greedy, best of {args.rounds}, {args.threads} thread(s).\n")
        if "generation" not in args.skip:
            print("\n".join(generation_table(folder, args)) + "\n", flush=True)
        if "tp" not in args.skip:
            print("## Tensor parallelism: tp=2 vs one process\n\n" + "\n".join(tensor_parallel_table(folder, args)) + "\n", flush=True)
    if "memory" not in args.skip:
        print("## Peak memory: behemoth generate vs transformers\n\n" + "\n".join(memory_table(args)) + "\n", flush=True)
    if "int8" not in args.skip:
        print("## int8 weight-only vs float32\n\n" + "\n".join(int8_table(args)) + "\n", flush=True)
    if "offload" not in args.skip:
        print("## Offload: largest model that fits vs largest that generates\n\n" + "\n".join(offload_table(args)), flush=True)
    write_rows(args.json, ROWS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
