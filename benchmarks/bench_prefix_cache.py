"""Prefix caching on a shared-prefix workload: prefill tokens computed and throughput, with and without it.

A random-weight Llama (bench_inference's shapes, saved as a local folder) serves W waves of R requests
each through behemoth's continuous-batching scheduler (the engine `behemoth serve` runs): every prompt is
one shared system prompt (90% of its tokens) and a distinct question; each request generates G greedy
tokens. Per mode: prompt tokens prefilled, prefix tokens reused, wall time, output tokens/s, and whether the
tokens equal the run without caching (they must). The peer is the same engine with caching off; the modes run
interleaved, twice each, and the faster run of each is reported (the machine may be loaded). Run:

    python benchmarks/bench_prefix_cache.py --quick       # the small Llama: about a minute
    python benchmarks/bench_prefix_cache.py               # the 25M Llama
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ratios import write_rows  # noqa: E402

from benchmarks.llama_models import SHAPES, save_llama  # noqa: E402


def workload(vocab: int, system: int, question: int, waves: int, per_wave: int) -> list[list[list[int]]]:
    """Waves of prompts: one shared system prompt of `system` tokens, then `question` tokens of each request's own."""
    import torch

    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, vocab, (system,), generator=g).tolist()
    return [[shared + torch.randint(3, vocab, (question,), generator=g).tolist() for _ in range(per_wave)] for _ in range(waves)]


def run(gen, prompts: list[list[list[int]]], new: int, prefix_caching: bool) -> dict:
    """Every wave through one scheduler (a wave starts when the previous has finished); counters and tokens."""
    from behemoth.inference.sampling import SamplingParams
    from behemoth.inference.scheduler import SchedulerPolicy

    sched = gen.scheduler(SchedulerPolicy(max_batch=64, context=gen.context, max_waiting=1 << 20, prefix_caching=prefix_caching))
    params = SamplingParams(max_tokens=new)
    tokens, start = [], time.perf_counter()
    for wave in prompts:
        requests = [sched.submit(p, params) for p in wave]
        sched.run_until_done()
        tokens += [r.output for r in requests]
    wall = time.perf_counter() - start
    out = sum(len(t) for t in tokens)
    return dict(tokens=tokens, wall_s=wall, out_tok_s=out / wall, **{k: sched.stats[k] for k in ("prefill_tokens", "prefix_hit_tokens")})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--waves", type=int, default=4)
    p.add_argument("--per-wave", type=int, default=8)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode, interleaved; the fastest is reported")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from behemoth.inference import CachePolicy, load

    shape = SHAPES["quick" if args.quick else "full"]
    system, question = (288, 32) if args.quick else (576, 64)  # 90% of each prompt shared
    with tempfile.TemporaryDirectory() as folder:
        save_llama(shape, folder)
        gen = load(folder, cache=CachePolicy(block_size=16, memory_mb=256))
        prompts = workload(shape["vocab_size"], system, question, args.waves, args.per_wave)
        run(gen, prompts[:1], 2, False)  # warm-up, untimed
        trials = [run(gen, prompts, args.new, caching) for _ in range(args.repeats) for caching in (False, True)]  # interleaved
        off, on = (min(trials[i::2], key=lambda r: r["wall_s"]) for i in (0, 1))  # the faster of each mode's repeats
    rows = []
    print(f"{'mode':<16}{'prefill tokens':>16}{'reused':>10}{'wall s':>9}{'out tok/s':>11}{'same tokens':>13}")
    for name, r in (("no caching", off), ("prefix caching", on)):
        same = r["tokens"] == off["tokens"]
        print(f"{name:<16}{r['prefill_tokens']:>16}{r['prefix_hit_tokens']:>10}{r['wall_s']:>9.2f}{r['out_tok_s']:>11.1f}{str(same):>13}")
        rows.append({"mode": name, **{k: v for k, v in r.items() if k != "tokens"}, "same_tokens": same})
    print(f"prefill tokens: {off['prefill_tokens'] / on['prefill_tokens']:.2f}x fewer; throughput {on['out_tok_s'] / off['out_tok_s']:.2f}x")
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
