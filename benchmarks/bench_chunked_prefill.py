"""Chunked prefill: inter-token latency of running streams while long prompts arrive, whole-prompt prefill vs chunks.

A random-weight Llama (bench_inference's shapes, saved as a local folder) runs S greedy streams through behemoth's
continuous-batching scheduler (the engine `behemoth serve` runs); once they decode, L long prompts arrive. Per
mode: the streams' inter-token gaps (p50, p99, max, over every gap after the arrival), the long prompts' time to
first token, the most tokens the model computed between two of the streams' tokens ("max work": the stall, independent
of how loaded the machine is), and whether every token equals the whole-prompt run's (it must). The baseline is the same streams
with no arrival; the peer is the same engine prefilling whole prompts (what it did before `--prefill-chunk`).
Modes run interleaved, twice each, and the faster run of each is reported (the machine may be loaded). Run:

    python benchmarks/bench_chunked_prefill.py --quick    # the small Llama: about a minute
    python benchmarks/bench_chunked_prefill.py            # the 25M Llama
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ratios import write_rows  # noqa: E402

from benchmarks.llama_models import SHAPES, save_llama  # noqa: E402


def prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run(gen, streams: list[list[int]], longs: list[list[int]], new: int, chunk: int | None, arrive_at: int = 4) -> dict:
    """Streams decode; at step `arrive_at` the long prompts arrive (none for the baseline). Gaps, TTFT, tokens."""
    from behemoth.inference.sampling import SamplingParams
    from behemoth.inference.scheduler import SchedulerPolicy

    sched = gen.scheduler(SchedulerPolicy(max_batch=64, context=gen.context, max_prefill_tokens=1 << 20, prefill_chunk=chunk))
    running = [sched.submit(p, SamplingParams(max_tokens=new)) for p in streams]
    arrived, step, gaps, last, work, most = [], 0, [], None, 0, 0
    while not sched.idle:
        if step == arrive_at:
            arrived = [sched.submit(p, SamplingParams(max_tokens=8)) for p in longs]
        before, computed = [len(r.output) for r in running], sched.stats["prefill_tokens"] + sched.stats["decode_tokens"]
        sched.step()
        now = time.perf_counter()
        work += sched.stats["prefill_tokens"] + sched.stats["decode_tokens"] - computed
        if any(len(r.output) > b for r, b in zip(running, before)):
            if last is not None and step >= arrive_at and any(r.finish_reason is None for r in running):
                gaps.append(now - last)
                most = max(most, work)
            last, work = now, 0
        step += 1
    ttft = [r.first_token_at - r.arrival for r in arrived]
    gaps.sort()
    return dict(
        tokens=[r.output for r in running + arrived],
        p50_ms=1e3 * statistics.median(gaps),
        p99_ms=1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
        max_ms=1e3 * gaps[-1],
        ttft_s=max(ttft) if ttft else 0.0,
        max_tokens_between=most,
        wall_s=sum(gaps),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--long", type=int, default=2, help="long prompts arriving")
    p.add_argument("--new", type=int, default=48, help="tokens each stream generates")
    p.add_argument("--chunks", default="64,128", help="prefill chunk sizes to compare")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from behemoth.inference import CachePolicy, load

    shape = SHAPES["quick" if args.quick else "full"]
    length = 448 if args.quick else 896
    chunks = [int(c) for c in args.chunks.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        save_llama(shape, folder)
        gen = load(folder, cache=CachePolicy(block_size=16, memory_mb=256))
        streams, longs = prompts(shape["vocab_size"], args.streams, 16, 0), prompts(shape["vocab_size"], args.long, length - 16, 1)
        run(gen, streams[:1], longs[:1], 8, 64)  # warm-up, untimed
        modes = [("no arrival", [], None), ("whole prompts", longs, None)] + [(f"chunk {c}", longs, c) for c in chunks]
        trials = [[run(gen, streams, lp, args.new, c) for name, lp, c in modes] for _ in range(args.repeats)]  # interleaved
        best = [min((t[i] for t in trials), key=lambda r: r["p99_ms"]) for i in range(len(modes))]
    base, whole = best[0], best[1]
    print(f"{args.streams} streams decoding, {args.long} prompts of {length - 16} tokens arriving; Llama {shape}\n")
    print(f"{'mode':<15}{'p50 gap ms':>11}{'p99 gap ms':>11}{'max gap ms':>11}{'p99/base':>9}{'long TTFT s':>12}{'max work':>9}{'same tokens':>12}")
    rows = []
    for (name, _, chunk), r in zip(modes, best):
        same = r["tokens"] == whole["tokens"] if name != "no arrival" else r["tokens"] == whole["tokens"][: args.streams]
        ratio = r["p99_ms"] / base["p99_ms"]
        ttft = f"{r['ttft_s']:.2f}" if name != "no arrival" else "-"
        print(
            f"{name:<15}{r['p50_ms']:>11.1f}{r['p99_ms']:>11.1f}{r['max_ms']:>11.1f}{ratio:>9.2f}{ttft:>12}"
            f"{r['max_tokens_between']:>9}{str(same):>12}"
        )
        numbers = {k: v for k, v in r.items() if k != "tokens"}
        rows.append({"mode": name, "prefill_chunk": chunk, **numbers, "p99_vs_base": ratio, "same_tokens": same})
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
