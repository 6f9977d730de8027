"""Layout-independent sampling: the batch of global step k depends on (seed, stream, k) alone.

Every rank draws the whole global batch's start offsets (a source per sequence by its mixture weight, then a
start inside that source's span), keeps its data-parallel shard, and cuts it into micro-batches; so every
layout sees the same sequences at the same step, and every rank can count the global batch's trained targets
(the loss's denominator) without communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from behemoth.data.corpus import Split
from behemoth.errors import BehemothError
from behemoth.models.causal_lm import IGNORE_INDEX


@dataclass(frozen=True)
class BatchLayout:
    """How a global batch is cut: `dp` data-parallel shards, each of `accum` micro-batches."""

    global_batch: int
    micro_batch: int
    dp: int

    @property
    def accum(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @classmethod
    def resolve(cls, global_batch: int, micro_batch: int | None, dp: int) -> BatchLayout:
        if micro_batch is None:
            if global_batch % dp:
                raise BehemothError(
                    f"train.global_batch={global_batch} does not divide over {dp} data-parallel ranks",
                    f"use a multiple of {dp} (e.g. {dp * max(1, round(global_batch / dp))})",
                )
            micro_batch = global_batch // dp
        if global_batch % (micro_batch * dp):
            raise BehemothError(
                f"train.global_batch={global_batch} is not a multiple of train.micro_batch={micro_batch} x dp={dp} = {micro_batch * dp}",
                "choose global_batch = micro_batch x dp x accumulation steps",
            )
        return cls(global_batch, micro_batch, dp)


def sample_offsets(n_tokens: int, seq_len: int, count: int, seed: int, step: int, stream: int = 0) -> np.ndarray:
    """`count` start offsets into one token stream for step `step`; depends on (seed, stream, step) only."""
    if n_tokens < seq_len + 1:
        raise BehemothError(
            f"the corpus split has {n_tokens} tokens, fewer than seq_len+1={seq_len + 1}", "use a larger corpus or a shorter train.seq_len"
        )
    rng = np.random.default_rng([seed, stream, step])
    return rng.integers(0, n_tokens - seq_len, size=count)


def split_offsets(split: Split, seq_len: int, count: int, seed: int, step: int, stream: int = 0) -> np.ndarray:
    """Start offsets of a mixture: each sequence's source drawn by weight, then a start in its span (a document's first
    token where the split has document starts)."""
    if len(split.spans) == 1 and split.starts is None:  # one source: exactly the draws of a plain token stream
        first_token, end = split.spans[0]
        return first_token + sample_offsets(end - first_token, seq_len, count, seed, step, stream)
    for (a, b), w in zip(split.spans, split.weights):
        if w > 0 and b - a < seq_len + 1:
            raise BehemothError(
                f"a data source's split has {b - a} tokens, fewer than seq_len+1={seq_len + 1}", "use a larger source or a shorter train.seq_len"
            )
    rng = np.random.default_rng([seed, stream, step])
    p = np.asarray(split.weights, dtype=np.float64)
    which = rng.choice(len(split.spans), size=count, p=p / p.sum())
    lo = np.array([split.spans[i][0] for i in which], dtype=np.int64)
    hi = np.array([split.spans[i][1] - seq_len for i in which], dtype=np.int64)
    if split.starts is None:
        return rng.integers(lo, hi)
    first, last = np.searchsorted(split.starts, lo), np.searchsorted(split.starts, hi)  # documents starting in [lo, hi)
    picked = rng.integers(first, np.maximum(last, first + 1))
    out: np.ndarray = np.where(last > first, np.asarray(split.starts)[np.minimum(picked, len(split.starts) - 1)], rng.integers(lo, hi))
    return out


def gather_batch(tokens: np.ndarray, offsets: np.ndarray, seq_len: int, mask: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets for the given start offsets; targets the mask leaves out are IGNORE_INDEX."""
    idx = offsets[:, None] + np.arange(seq_len + 1)[None, :]
    window = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    targets = window[:, 1:]
    if mask is not None:
        keep = torch.from_numpy(np.asarray(mask[idx[:, 1:]], dtype=np.bool_))
        targets = targets.masked_fill(~keep, IGNORE_INDEX)
    return window[:, :-1], targets


def as_split(data: np.ndarray | Split) -> Split:
    return data if isinstance(data, Split) else Split(data, None, [(0, len(data))], [1.0])


class BatchSampler:
    """This rank's micro-batches of any global step, and the global batch's count of trained targets."""

    def __init__(self, data: np.ndarray | Split, seq_len: int, layout: BatchLayout, dp_rank: int, seed: int, stream: int = 0) -> None:
        self.split, self.seq_len, self.layout, self.dp_rank, self.seed, self.stream = as_split(data), seq_len, layout, dp_rank, seed, stream
        self.tokens = self.split.tokens

    def offsets(self, step: int) -> np.ndarray:
        return split_offsets(self.split, self.seq_len, self.layout.global_batch, self.seed, step, self.stream)

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        lay = self.layout
        offsets = self.offsets(step)
        per_rank = lay.global_batch // lay.dp
        mine = offsets[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        return [gather_batch(self.tokens, mine[i : i + lay.micro_batch], self.seq_len, self.split.mask) for i in range(0, per_rank, lay.micro_batch)]

    def trained_targets(self, step: int) -> int:
        """Targets of the whole global batch of `step` that the loss counts (every rank computes the same number)."""
        if self.split.mask is None:
            return self.layout.global_batch * self.seq_len
        idx = self.offsets(step)[:, None] + np.arange(1, self.seq_len + 1)[None, :]
        return int(np.asarray(self.split.mask[idx], dtype=np.int64).sum())
