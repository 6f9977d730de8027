"""Chunked prefill: inter-token latency of running streams while long prompts arrive, whole-prompt prefill vs chunks.

A random-weight Llama (bench_inference's shapes, saved as a local folder) runs S greedy streams through behemoth's
continuous-batching scheduler (the engine `behemoth serve` runs); once they decode, L long prompts arrive. Modes: no
arrival (the baseline), whole prompts (the peer: what the engine did before `--prefill-chunk`), fixed chunks of N tokens
(`--prefill-chunk N`: each chunk in one packed forward with the decodes), the same chunks in a forward of their own beside
the decode forward (`2 fwd`, how chunks ran before packing), and `--prefill-chunk auto` (the chunk of every step chosen
from step times measured once at start, within `--factor` x a decode-only step). Per mode: the streams' inter-token
gaps (p50, p99, max, over every gap after the arrival) in wall time and in this process's CPU time (less sensitive to
other work on the machine), the long prompts' time to first token (wall and CPU), the most tokens the model computed between two of
the streams' tokens ("max work", independent of load), the steps that carried a chunk, and whether every token equals
the whole-prompt run's (it must). Modes run interleaved, `--repeats` times each, and the run with the lowest p99 CPU
gap of each is reported. Run:

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


def percentiles(gaps: list[float]) -> tuple[float, float, float]:
    """p50, p99 and max of `gaps` in milliseconds."""
    gaps = sorted(gaps)
    return 1e3 * statistics.median(gaps), 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))], 1e3 * gaps[-1]


def scheduler(gen, mode: dict, budget):
    """The engine's scheduler for a mode: fixed chunks, packed or not, the measured budget, or whole prompts."""
    from behemoth.inference.kv_cache import BlockAllocator
    from behemoth.inference.scheduler import Scheduler, SchedulerPolicy

    policy = SchedulerPolicy(max_batch=64, context=gen.context, max_prefill_tokens=1 << 20, prefill_chunk=mode["chunk"], step_factor=mode["factor"])
    sched = Scheduler(gen.runner, BlockAllocator(gen.num_blocks, gen.block_size), policy, gen.tokenizer, budget=budget)
    sched.packs = sched.packs and not mode["two_forwards"]
    return sched


def run(gen, streams: list[list[int]], longs: list[list[int]], new: int, mode: dict, budget=None, arrive_at: int = 4) -> dict:
    """Streams decode; at step `arrive_at` the long prompts arrive (none for the baseline). Gaps, TTFT, work, tokens."""
    from behemoth.inference.sampling import SamplingParams

    sched = scheduler(gen, mode, budget)
    running = [sched.submit(p, SamplingParams(max_tokens=new)) for p in streams]
    arrived, step, gaps, cpu_gaps, last, work, most, chunk_steps, cpu_ttft = [], 0, [], [], None, 0, 0, 0, {}
    while not sched.idle:
        if step == arrive_at:
            arrived, cpu_arrival = [sched.submit(p, SamplingParams(max_tokens=8)) for p in longs], time.process_time()
        before, computed, prefilled = [len(r.output) for r in running], sched.stats["decode_tokens"], sched.stats["prefill_tokens"]
        sched.step()
        now, cpu = time.perf_counter(), time.process_time()
        work += sched.stats["prefill_tokens"] + sched.stats["decode_tokens"] - computed - prefilled
        cpu_ttft.update({r.id: cpu - cpu_arrival for r in arrived if r.output and r.id not in cpu_ttft})
        if any(len(r.output) > b for r, b in zip(running, before)):
            if last is not None and step >= arrive_at and any(r.finish_reason is None for r in running):
                gaps.append(now - last[0])
                cpu_gaps.append(cpu - last[1])
                most = max(most, work)
                chunk_steps += sched.stats["prefill_tokens"] > prefilled
            last, work = (now, cpu), 0
        step += 1
    ttft = [r.first_token_at - r.arrival for r in arrived]
    p50, p99, top = percentiles(gaps)
    cpu50, cpu99, _ = percentiles(cpu_gaps)
    return dict(
        tokens=[r.output for r in running + arrived],
        p50_ms=p50,
        p99_ms=p99,
        max_ms=top,
        cpu_p50_ms=cpu50,
        cpu_p99_ms=cpu99,
        ttft_s=max(ttft) if ttft else 0.0,
        cpu_ttft_s=max(cpu_ttft.values()) if cpu_ttft else 0.0,
        max_tokens_between=most,
        gaps=len(gaps),
        chunk_gaps=chunk_steps,
        wall_s=sum(gaps),
    )


def modes_of(args: argparse.Namespace) -> list[dict]:
    """The modes compared: (name, prompts arrive, prefill_chunk, step factor, chunks in a forward of their own)."""
    mode = lambda name, arrive, chunk, two=False: dict(name=name, arrive=arrive, chunk=chunk, factor=args.factor, two_forwards=two)  # noqa: E731
    chunks = [int(c) for c in args.chunks.split(",") if c]
    out = [mode("no arrival", False, None), mode("whole prompts", True, None)]
    out += [mode(f"chunk {c}", True, c) for c in chunks] + [mode(f"chunk {c} 2 fwd", True, c, True) for c in chunks if args.two_forwards]
    return out + [mode(f"auto {args.factor:g}x", True, "auto")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--long", type=int, default=2, help="long prompts arriving")
    p.add_argument("--new", type=int, default=48, help="tokens each stream generates")
    p.add_argument("--chunks", default="32,128", help="fixed prefill chunk sizes to compare")
    p.add_argument("--two-forwards", action="store_true", help="also run the fixed chunks in a forward of their own (unpacked)")
    p.add_argument("--factor", type=float, default=1.5, help="auto's step factor (a step within this x a decode-only step)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from behemoth.inference import CachePolicy, load

    shape = SHAPES["quick" if args.quick else "full"]
    length = 448 if args.quick else 896
    with tempfile.TemporaryDirectory() as folder:
        save_llama(shape, folder)
        gen = load(folder, cache=CachePolicy(block_size=16, memory_mb=256))
        streams, longs = prompts(shape["vocab_size"], args.streams, 16, 0), prompts(shape["vocab_size"], args.long, length - 16, 1)
        modes = modes_of(args)
        run(gen, streams[:1], longs[:1], 8, modes[2])  # warm-up, untimed
        started = time.perf_counter()
        budget = scheduler(gen, modes[-1], None).budget  # measured once, as the server does at start
        print(f"auto budget measured in {time.perf_counter() - started:.1f} s: {budget.describe()}\n")
        trials = [[run(gen, streams, longs if m["arrive"] else [], args.new, m, budget) for m in modes] for _ in range(args.repeats)]
        best = [min((t[i] for t in trials), key=lambda r: r["cpu_p99_ms"]) for i in range(len(modes))]
        seen = budget.observed
        if seen is not None:  # the served steps' correction the auto runs taught the budget (step_budget.Observed)
            print(
                f"served mixed steps against the measurement after the runs: {seen.mixed:.2f}x their prediction "
                f"({seen.mixed_steps} steps): the limit scaled by {seen.scale:.2f}\n"
            )
    report(args, shape, length, modes, best)


def report(args: argparse.Namespace, shape: dict, length: int, modes: list[dict], best: list[dict]) -> None:
    base, whole = best[0], best[1]
    print(f"{args.streams} streams decoding, {args.long} prompts of {length - 16} tokens arriving; Llama {shape}\n")
    print(
        f"{'mode':<17}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}{'p99/base':>9}{'cpu p99':>8}{'cpu/base':>9}{'TTFT s':>8}{'cpu TTFT':>9}"
        f"{'max work':>9}{'chunk gaps':>11}{'same':>6}"
    )
    rows = []
    for mode, r in zip(modes, best):
        same = r["tokens"] == whole["tokens"] if mode["arrive"] else r["tokens"] == whole["tokens"][: args.streams]
        ratio, cpu_ratio = r["p99_ms"] / base["p99_ms"], r["cpu_p99_ms"] / base["cpu_p99_ms"]
        ttft, cpu_ttft = (f"{r['ttft_s']:.2f}", f"{r['cpu_ttft_s']:.2f}") if mode["arrive"] else ("-", "-")
        print(
            f"{mode['name']:<17}{r['p50_ms']:>8.1f}{r['p99_ms']:>8.1f}{r['max_ms']:>8.1f}{ratio:>9.2f}{r['cpu_p99_ms']:>8.1f}{cpu_ratio:>9.2f}"
            f"{ttft:>8}{cpu_ttft:>9}{r['max_tokens_between']:>9}{r['chunk_gaps']:>5}/{r['gaps']:<5}{str(same):>6}"
        )
        numbers = {k: v for k, v in r.items() if k != "tokens"}
        rows.append(
            {"mode": mode["name"], "prefill_chunk": mode["chunk"], **numbers, "p99_vs_base": ratio, "cpu_p99_vs_base": cpu_ratio, "same_tokens": same}
        )
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
