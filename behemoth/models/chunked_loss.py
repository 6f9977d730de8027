"""A language-model loss that never holds a micro-batch's full logits: the head's linear layer and the cross-entropy, in
chunks of tokens.

    head = ChunkedHead.install(lm, loss_chunk)     # the head's projection can leave its input for the loss
    with head.deferred():                          # (the engine's loss paths: train and evaluate)
        out = lm.logits(ids)                       # the final norm's output, marked with what the head would multiply
        loss = summed_token_loss(out, targets)     # chunk by chunk: logits, log-sum-exp, picked logit, then freed

Forward keeps one float32 log-sum-exp per token; backward recomputes each chunk's logits from the saved hidden states
and weight, turns them into the softmax minus the one-hot target, and multiplies it into the hidden states' and the
weight's gradients before the next chunk: the head's peak memory is one chunk's logits (a few copies of
[chunk, vocab]), not the micro-batch's. The price is one more head matmul per token (the recomputation). Under
tensor parallelism each rank holds a vocabulary shard; the maximum and the sums of exponentials and picked logits
are all-reduced per chunk (`VocabSplit`), as the vocabulary-parallel loss does for the whole micro-batch.

`train.loss_chunk` sets the tokens per chunk (0: never); its default, -1, chunks only a micro-batch whose float32
logits on this rank would exceed AUTO_BYTES, in chunks of about CHUNK_BYTES of logits (`chunk_tokens`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100  # as models/causal_lm.py: a target the loss leaves out
HEAD_INPUT = "_behemoth_head_input"  # the attribute a deferred head's output carries
AUTO_BYTES = 1 << 30  # loss_chunk=-1: chunk when a micro-batch's float32 logits on this rank exceed 1 GiB
CHUNK_BYTES = 256 << 20  # ... in chunks of at most 256 MiB of float32 logits (a power of two of tokens, at least 64)


@dataclass(frozen=True)
class HeadInput:
    """What the head would have multiplied: its weight ([vocab, d], or [d, vocab] when transposed), bias, the matmul's
    dtype (autocast's where it was on) and the tokens per chunk."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    transposed: bool
    dtype: torch.dtype
    chunk: int


@dataclass(frozen=True)
class VocabSplit:
    """This rank's vocabulary shard, [start, start + real) of the full vocabulary, and the tp all-reduce
    (`all_reduce(t, op)`, in place; op "max" or "sum")."""

    start: int
    real: int
    all_reduce: Callable[[torch.Tensor, str], Any]


def chunk_tokens(loss_chunk: int, tokens: int, vocab: int) -> int | None:
    """Tokens per chunk for a micro-batch of `tokens` over `vocab` logits on this rank, or None: no chunking."""
    if loss_chunk > 0:
        return loss_chunk
    if loss_chunk == 0 or tokens * vocab * 4 <= AUTO_BYTES:
        return None
    return max(64, 1 << max(0, (CHUNK_BYTES // (vocab * 4)).bit_length() - 1))


def head_input_of(t: torch.Tensor) -> HeadInput | None:
    """The head input a deferred head marked `t` with, or None (real logits)."""
    return getattr(t, HEAD_INPUT, None)


def _logits(h: torch.Tensor, head: HeadInput) -> torch.Tensor:
    """One chunk's logits in float32, computed as the head computes them (same dtype, same matmul)."""
    w = head.weight.to(head.dtype)
    b = None if head.bias is None else head.bias.to(head.dtype)
    x = h.to(head.dtype)
    y = F.linear(x, w, b) if not head.transposed else (x @ w if b is None else torch.addmm(b, x, w))
    return y.float()


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor, split: VocabSplit | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: log-sum-exp over the (full) vocabulary and the target's logit (0 for an ignored target). Consumes
    `logits` (exponentiated in place: one [chunk, vocab] buffer, no temporaries of its size)."""
    start, real = (0, logits.shape[1]) if split is None else (split.start, split.real)
    mine = (targets >= start) & (targets < start + real)
    mine &= targets != IGNORE_INDEX
    picked = logits.gather(1, torch.where(mine, targets - start, 0).unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
    part = logits[:, :real]
    peak = part.amax(dim=1) if real else part.new_full((part.shape[0],), float("-inf"))
    if split is not None:
        split.all_reduce(peak, "max")
    sums = torch.stack([part.sub_(peak.unsqueeze(1)).exp_().sum(dim=1), picked])
    if split is not None:
        split.all_reduce(sums, "sum")  # every rank's share of the exponentials, and the one rank's picked logit
    return torch.log(sums[0]) + peak, sums[1]


def _softmax_minus_target(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, split: VocabSplit | None) -> torch.Tensor:
    """d(summed loss)/d(logits) of one chunk, in `logits`' storage: softmax - one-hot, zero rows for ignored targets and
    padding columns."""
    start, real = (0, logits.shape[1]) if split is None else (split.start, split.real)
    grad = logits.sub_(lse.unsqueeze(1)).exp_()  # in place: a chunk's logits are fresh (one [chunk, vocab] buffer)
    if real < grad.shape[1]:
        grad[:, real:] = 0.0
    mine = (targets >= start) & (targets < start + real)
    rows = torch.arange(grad.shape[0], device=grad.device)[mine]
    grad[rows, targets[mine] - start] -= 1.0
    return grad.masked_fill_((targets == IGNORE_INDEX).unsqueeze(1), 0.0)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed token cross-entropy of h W^T + b, chunk by chunk along the tokens, logits recomputed in backward."""

    @staticmethod
    def forward(
        ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, head: HeadInput, split: VocabSplit | None
    ) -> torch.Tensor:
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        view = HeadInput(weight, bias, head.transposed, head.dtype, head.chunk)
        for at in range(0, h.shape[0], head.chunk):
            t = targets[at : at + head.chunk]
            lse[at : at + head.chunk], picked = _chunk_stats(_logits(h[at : at + head.chunk], view), t, split)
            total += (lse[at : at + head.chunk] - picked).masked_fill(t == IGNORE_INDEX, 0.0).sum()
        ctx.save_for_backward(h, weight, bias, targets, lse)
        ctx.head, ctx.split = head, split
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, weight, bias, targets, lse = ctx.saved_tensors
        head, split, (want_h, want_w, want_b) = ctx.head, ctx.split, ctx.needs_input_grad[:3]
        view = HeadInput(weight, bias, head.transposed, head.dtype, head.chunk)
        w = weight.to(head.dtype)
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_b else None
        for at in range(0, h.shape[0], head.chunk):
            x = h[at : at + head.chunk]
            g = _softmax_minus_target(_logits(x, view), lse[at : at + head.chunk], targets[at : at + head.chunk], split).mul_(grad).to(head.dtype)
            if grad_h is not None:
                grad_h[at : at + head.chunk] = g @ w.t() if head.transposed else g @ w
            if grad_w is not None:
                _accumulate(grad_w, *((x.to(head.dtype).t(), g) if head.transposed else (g.t(), x.to(head.dtype))))
            if grad_b is not None:
                grad_b += g.float().sum(0)
            del g  # before the next chunk's logits: one chunk's at a time
        return grad_h, _cast(grad_w, weight), _cast(grad_b, bias), None, None, None


def _accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b, in place where the dtypes allow (no [vocab, d] temporary per chunk)."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    else:
        out += (a @ b).float()


def _cast(g: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if g is None or like is None else g.to(like.dtype)


def chunked_cross_entropy_sum(out: torch.Tensor, targets: torch.Tensor, split: VocabSplit | None = None) -> torch.Tensor:
    """Summed token cross-entropy (float32) of a deferred head's output against `targets`, never holding its logits."""
    head = head_input_of(out)
    if head is None:
        raise TypeError("chunked_cross_entropy_sum takes a deferred head's output (ChunkedHead.deferred)")
    h = out.reshape(-1, out.shape[-1])
    return ChunkedLinearCrossEntropy.apply(h, head.weight, head.bias, targets.reshape(-1), head, split)


Projection = Callable[[], tuple[torch.Tensor, torch.Tensor | None, bool]]  # () -> (weight, bias, transposed), read at call time


class ChunkedHead:
    """Switches a model's logits projection between computing logits and, inside `deferred()`, leaving its input
    (marked with a `HeadInput`) for the chunked loss. Installed on the instance: parameter names and hooks stay."""

    def __init__(self, owner: nn.Module, method: str, params: Projection, loss_chunk: int) -> None:
        self.owner, self.method, self.params, self.loss_chunk = owner, method, params, loss_chunk
        self.active = False
        plain = getattr(owner, method)

        def project(x: torch.Tensor) -> torch.Tensor:
            if not self.active:
                return plain(x)
            weight, bias, transposed = self.params()
            chunk = chunk_tokens(self.loss_chunk, x.numel() // x.shape[-1], weight.shape[1 if transposed else 0])
            if chunk is None:
                return plain(x)
            out = x.view_as(x)
            setattr(out, HEAD_INPUT, HeadInput(weight, bias, transposed, _matmul_dtype(x, weight), chunk))
            return out

        setattr(owner, method, project)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Within: the projection leaves its input for the loss (when `chunk_tokens` chunks this micro-batch)."""
        self.active = True
        try:
            yield
        finally:
            self.active = False


def _matmul_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else torch.promote_types(x.dtype, weight.dtype)
