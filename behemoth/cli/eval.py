"""`behemoth eval`: the loss and perplexity of a trained run (or an HF folder) on a corpus, in one process.

The corpus is tokenized as the run's training data was (its tokenizer, its chat masking) and packed as it was: in
consecutive windows of the run's sequence length, or, where the run started its sequences at documents
(data.packing=document, the default for chats), each document read from its first token in windows of that length, a
window counting only its own document's targets. Either way every counted target is scored once.
"""

from __future__ import annotations

import argparse
import itertools
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


def document_windows(split: Any, seq_len: int, max_windows: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows that read each document of `split` (its `starts`) from its first token: start offsets of seq_len + 1
    tokens and, per window, the last target position it counts (its document's last token); at most `max_windows`. A
    document's targets are its tokens after the first, each in exactly one window."""
    starts = np.asarray(split.starts, dtype=np.int64)
    span_ends = np.array([hi for _, hi in split.spans], dtype=np.int64)
    in_span = np.minimum(np.searchsorted(span_ends, starts, side="right"), len(span_ends) - 1)
    ends = np.minimum(np.append(starts[1:], len(split.tokens)), span_ends[in_span])
    every = ((o, min(o + seq_len, e - 1)) for s, e in zip(starts.tolist(), ends.tolist()) for o in range(s, e - 1, seq_len))
    rows = np.array(list(itertools.islice(every, max_windows)), dtype=np.int64).reshape(-1, 2)
    return rows[:, 0], rows[:, 1]


def _counted_only(targets: torch.Tensor, first: np.ndarray, last: np.ndarray, offsets: np.ndarray) -> torch.Tensor:
    """Targets outside each window's [first, last] token positions left out (IGNORE_INDEX)."""
    from behemoth.models.causal_lm import IGNORE_INDEX

    pos = torch.from_numpy(offsets)[:, None] + 1 + torch.arange(targets.shape[1])[None, :]
    keep = (pos >= torch.from_numpy(first)[:, None]) & (pos <= torch.from_numpy(last)[:, None])
    return targets.masked_fill(~keep, IGNORE_INDEX)


@torch.no_grad()
def corpus_loss(model: Any, split: Any, seq_len: int, batch: int, max_tokens: int) -> tuple[float, int]:
    """Summed loss and counted targets of the split's windows: consecutive, or per document where it has starts."""
    from behemoth.data import gather_batch
    from behemoth.models.causal_lm import counted_targets

    firsts: np.ndarray | None = None
    lasts: np.ndarray | None = None
    if split.starts is not None and len(split.starts):
        wanted, lasts = document_windows(split, seq_len, max(1, max_tokens // seq_len))
        offsets = np.minimum(wanted, len(split.tokens) - seq_len - 1)  # one near the split's end starts earlier, counting
        firsts = wanted + 1  # from where its document's previous window stopped
    else:
        offsets = windows(split.spans, seq_len, max(1, max_tokens // seq_len))
    if not offsets.size or offsets.min() < 0:
        raise BehemothError(f"the corpus split holds no window of seq_len+1={seq_len + 1} tokens", "use a larger corpus or train.seq_len=SHORTER")
    total, count = 0.0, 0
    for i in range(0, offsets.size, batch):
        inputs, targets = gather_batch(split.tokens, offsets[i : i + batch], seq_len, split.mask)
        if firsts is not None and lasts is not None:
            targets = _counted_only(targets, firsts[i : i + batch], lasts[i : i + batch], offsets[i : i + batch])
        total += float(model.loss_sum(model.logits(inputs.to(model.rt.device)), targets.to(model.rt.device)))
        count += int(counted_targets(targets))
    return total, count


def run_eval(args: argparse.Namespace) -> int:
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
            s, c = corpus_loss(model, part, cfg.seq_len, args.batch, args.max_tokens - count)
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
