"""`behemoth eval`: the loss and perplexity of a trained run (or an HF folder) on a corpus, in one process.

The corpus is tokenized as the run's training data was (its tokenizer, its chat masking), and read in consecutive
windows of the run's sequence length, so every counted target is scored once.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import numpy as np
import torch

from behemoth.errors import BehemothError, exit_code

EXAMPLES = """examples:
  behemoth eval runs/20261201-101500                          # the run's own validation split
  behemoth eval runs/X --data ~/held_out.jsonl                # every document of another corpus
  behemoth eval ./my-llama --data notes/ --max-tokens 200000  # an HF folder, with its tokenizer
"""


def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="behemoth eval", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__)
    p.add_argument("source", help="a run directory (its latest checkpoint), a checkpoint folder or a save_pretrained folder")
    p.add_argument("--data", default=None, help="corpus to score (file, folder, glob; default: the run's data, validation split)")
    p.add_argument("--split", choices=["val", "train", "all"], default=None, help="which split (default: all with --data, else val)")
    p.add_argument("--max-tokens", type=int, default=1_000_000, help="score at most this many targets (default 1,000,000)")
    p.add_argument("--batch", type=int, default=8, help="sequences per forward (default 8)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config options, e.g. train.seq_len=64 data.field=body")
    return p


def windows(spans: list[tuple[int, int]], seq_len: int, max_windows: int) -> np.ndarray:
    """Start offsets of consecutive windows of seq_len + 1 tokens inside each span (at most `max_windows`)."""
    starts = [np.arange(lo, hi - seq_len, seq_len) for lo, hi in spans if hi - lo > seq_len]
    out = np.concatenate(starts) if starts else np.zeros(0, np.int64)
    return out[:max_windows]


@torch.no_grad()
def corpus_loss(model: Any, split: Any, seq_len: int, batch: int, max_tokens: int) -> tuple[float, int]:
    """Summed loss and counted targets of the split's consecutive windows."""
    from behemoth.data import gather_batch
    from behemoth.models.causal_lm import counted_targets

    offsets = windows(split.spans, seq_len, max(1, max_tokens // seq_len))
    if not offsets.size:
        raise BehemothError(f"the corpus split holds no window of seq_len+1={seq_len + 1} tokens", "use a larger corpus or train.seq_len=SHORTER")
    total, count = 0.0, 0
    for i in range(0, offsets.size, batch):
        inputs, targets = gather_batch(split.tokens, offsets[i : i + batch], seq_len, split.mask)
        total += float(model.loss_sum(model.logits(inputs.to(model.rt.device)), targets.to(model.rt.device)))
        count += int(counted_targets(targets))
    return total, count


def run_eval(args: argparse.Namespace) -> int:
    from behemoth.data import Split
    from behemoth.inference.loading import load_model, resolve_source
    from behemoth.topology import init_runtime

    overrides = list(args.overrides) + ([f"data.path={args.data}", "data.sources=null"] if args.data else [])
    source = resolve_source(args.source, overrides)
    cfg = source.config
    corpus = cfg.prepare_corpus(progress=True)
    problem = corpus.vocab_problem(cfg.model.vocab_size)
    if problem:
        raise BehemothError(problem)
    name = args.split or ("all" if args.data else "val")
    parts = [cfg.corpus_split(corpus, s) for s in (("train", "val") if name == "all" else (name,))]
    rt = init_runtime(timeout_s=cfg.run.timeout_s)
    try:
        model = load_model(source, rt)
        total, count = 0.0, 0
        for part in parts:
            s, c = corpus_loss(model, Split(part.tokens, part.mask, part.spans, part.weights), cfg.seq_len, args.batch, args.max_tokens - count)
            total, count = total + s, count + c
            if count >= args.max_tokens:
                break
    finally:
        rt.close()
    if not count:
        raise BehemothError(
            f"the {name} split's windows of {cfg.seq_len} tokens hold no trained target (a chat's prompts only)",
            "score more of the corpus (--split all, --data), longer windows (train.seq_len=N) or data.loss_on=all",
        )
    loss = total / count
    result = {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "targets": count, "split": name, "corpus": str(corpus.folder)}
    print(json.dumps(result) if args.json else f"loss {loss:.4f}  perplexity {result['perplexity']:.2f}  ({count} targets, {name} split)")
    return 0


def eval_main(argv: list[str]) -> int:
    args = eval_parser().parse_intermixed_args(argv)
    return exit_code(run_eval, args)
