"""Speculative decoding at batch 1: tokens/s and acceptance rate with a draft model, against the same engine without one.

A random-weight Llama (bench_inference's shapes, saved as a local folder) is the target. Drafts: the target itself
(every token accepted: the mechanics at their best, though a draft as costly as the target cannot be faster),
the target truncated to its first `--keep` layers (its own embedding, norm and head), and an unrelated 1-layer
random Llama. Random weights make a truncated model a poor predictor of the full one: a trained small model of
the same family is what speculative decoding is for, and none is available offline here. Per mode: output
tokens/s, acceptance (draft tokens kept / proposed), tokens per target forward, and whether the tokens equal the
no-draft run's (greedy: they must). Modes run interleaved, `--repeats` times, the fastest reported.

n-gram (prompt lookup) proposals need no draft model: they help exactly when the text repeats. Two workloads: the
target above ("varied": its random-weight greedy output does not repeat, so lookup finds little), and the same
weights scaled down ("repeating": a small init whose greedy output falls into a cycle, as a model copying from its
prompt or repeating a pattern does), each against its own no-draft run.

`--part trained` trains a byte-level target (8 layers, width 512) and a 1-layer draft here with `behemoth train`
(speculative_trained.py) and measures held-out prompts greedy and sampled. Run:

    python benchmarks/bench_speculative.py --quick     # the small Llama: about a minute
    python benchmarks/bench_speculative.py             # the 25M Llama
    python benchmarks/bench_speculative.py --part trained --runs /tmp/spec-runs   # trains (minutes), keeps the runs
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ratios import write_rows  # noqa: E402

from benchmarks.llama_models import SHAPES, make_prompts, save_llama  # noqa: E402


def save_truncated(target: str, keep: int, out: str) -> None:
    """The target with only its first `keep` decoder layers (embedding, final norm and head unchanged)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target, local_files_only=True)
    model.model.layers = model.model.layers[:keep]
    model.config.num_hidden_layers = keep
    model.save_pretrained(out)


def run(gen, prompt: list[int], new: int) -> dict:
    """One greedy request at batch 1: its tokens, wall time and the scheduler's counters."""
    from behemoth.inference.sampling import SamplingParams

    sched = gen.scheduler()
    start = time.perf_counter()
    req = sched.submit(prompt, SamplingParams(max_tokens=new))
    sched.run_until_done()
    wall = time.perf_counter() - start
    return dict(tokens=req.output, wall_s=wall, tok_s=len(req.output) / wall, **sched.stats)


def save_scaled(target: str, factor: float, out: str) -> None:
    """The target with every weight but the norms' scaled by `factor`: a smaller init, whose greedy output repeats."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target, local_files_only=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(factor)
    model.save_pretrained(out)


def print_table(workloads: dict[str, dict[str, dict]], args: argparse.Namespace) -> list[dict]:
    """Per workload, each mode's best run against that workload's no-draft run; the rows for --json."""
    print(f"{'workload':<12}{'draft':<18}{'tok/s':>8}{'vs none':>9}{'accepted':>10}{'tok/forward':>13}{'same tokens':>13}")
    rows = []
    for workload, best in workloads.items():
        base = best["no draft"]
        for name, r in best.items():
            rate = r["accepted_tokens"] / r["draft_tokens"] if r.get("draft_tokens") else float("nan")
            per_forward = (len(r["tokens"]) - 1) / max(1, r["steps"] - 1)  # the prefill step gives 1, then a target forward a step
            same = r["tokens"] == base["tokens"]
            vs = r["tok_s"] / base["tok_s"]
            print(f"{workload:<12}{name:<18}{r['tok_s']:>8.1f}{vs:>9.2f}{rate:>10.2f}{per_forward:>13.2f}{str(same):>13}")
            rows.append({"workload": workload, "draft": name, "tok_s": r["tok_s"], "vs_none": vs, "acceptance": rate, "same_tokens": same})
    return rows


def trials(modes: dict[str, tuple], prompt: list[int], args: argparse.Namespace) -> dict[str, dict]:
    """Each mode (a generator and its draft) run `--repeats` times, interleaved; the fastest run of each."""
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for gen, _ in {id(g): (g, d) for g, d in modes.values()}.values():
        gen.draft = None
        run(gen, prompt, 8)  # warm-up, untimed
    for _ in range(args.repeats):
        for name, (gen, draft) in modes.items():
            gen.draft = draft
            runs[name].append(run(gen, prompt, args.new))
    return {name: max(t, key=lambda r: r["tok_s"]) for name, t in runs.items()}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["random", "trained"], default="random", help="random-weight models, or a pair trained here")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--keep", type=int, default=2, help="layers of the truncated draft")
    p.add_argument("--scale", type=float, default=0.2, help="weight scale of the repeating target (its init std is 0.1 x this)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=60, help="trained: the target's training steps (8 x 128 tokens each)")
    p.add_argument("--draft-steps", type=int, default=200, help="trained: the draft's training steps")
    p.add_argument("--distill", type=int, default=128, help="trained: the draft learns from this many target continuations (0: the corpus)")
    p.add_argument("--ks", type=lambda s: [int(k) for k in s.split(",")], default=[2, 3, 4, 5], help="trained: draft tokens per step")
    p.add_argument("--temperatures", type=lambda s: [float(t) for t in s.split(",") if t], default=[0.8], help="trained: sampled workloads")
    p.add_argument("--prompts", type=int, default=4, help="trained: held-out prompts, each decoded alone")
    p.add_argument("--runs", default=None, help="trained: keep (and reuse) the trained runs in this folder, not a temporary one")
    p.add_argument("--json", default=None)
    return p.parse_args()


def main_trained(args: argparse.Namespace) -> None:
    """Train the pair (or reuse --runs), then measure batch-1 greedy decode with and without speculation."""
    from speculative_trained import DRAFT, TARGET, measure, print_trained, train_pair

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.runs or tmp)
        root.mkdir(parents=True, exist_ok=True)
        seconds = train_pair(root, args)
        workloads = measure(root, args)
    print(f"batch 1, {args.prompts} held-out prompts of {args.prompt} bytes, {args.new} tokens each; byte-level Llamas trained here")
    print(f"target {TARGET} ({args.steps} steps); draft {DRAFT} ({args.draft_steps} steps, distill={args.distill})\n")
    write_rows(args.json, print_trained(workloads, seconds, args))


def main() -> None:
    args = parse_args()
    if args.part == "trained":
        return main_trained(args)
    from behemoth.inference import load
    from behemoth.inference.generate import draft_for
    from behemoth.inference.ngram import NgramDraft
    from behemoth.topology import init_runtime

    shape = SHAPES["quick" if args.quick else "full"]
    ngram = NgramDraft(args.draft_tokens)
    with tempfile.TemporaryDirectory() as root:
        target, truncated, other, repeating = (str(Path(root) / n) for n in ("target", "truncated", "other", "repeating"))
        save_llama(shape, target)
        save_truncated(target, args.keep, truncated)
        save_llama({**shape, "n_layer": 1}, other)
        save_scaled(target, args.scale, repeating)
        gen, rep = load(target), load(repeating)
        drafts = {"target itself": target, f"first {args.keep} layers": truncated, "other 1-layer": other}
        varied = {"no draft": (gen, None), **{n: (gen, draft_for(gen, f, args.draft_tokens, init_runtime(), 256.0)) for n, f in drafts.items()}}
        prompt = make_prompts(1, args.prompt, shape["vocab_size"])[0]
        workloads = {
            "varied": trials({**varied, "ngram": (gen, ngram)}, prompt, args),
            "repeating": trials({"no draft": (rep, None), "ngram": (rep, ngram)}, prompt, args),
        }
    print(f"batch 1, {args.prompt}-token prompt, {args.new} greedy tokens, K={args.draft_tokens}; Llama {shape}")
    print(f"varied: init std 0.1 (output does not repeat); repeating: the same weights x {args.scale} (its greedy output cycles)\n")
    write_rows(args.json, print_table(workloads, args))


if __name__ == "__main__":
    main()
