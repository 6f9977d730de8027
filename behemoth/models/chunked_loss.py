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

`train.loss_chunk` sets the tokens per chunk (0: the plain head and loss); its default, -1, chunks only a micro-batch
whose float32 logits on this rank would exceed AUTO_BYTES, in chunks of about CHUNK_BYTES of logits (`chunk_tokens`),
and computes a smaller one's loss fused whole (`LinearCrossEntropy`: logits once, vocabulary-major, kept and turned into
their own gradient in place; no recomputation, one logits buffer instead of the plain path's three).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from behemoth.models import gemm

IGNORE_INDEX = -100  # as models/causal_lm.py: a target the loss leaves out
HEAD_INPUT = "_behemoth_head_input"  # the attribute a deferred head's output carries
AUTO_BYTES = 1 << 30  # loss_chunk=-1: chunk when a micro-batch's float32 logits on this rank exceed 1 GiB
CHUNK_BYTES = 256 << 20  # ... in chunks of at most 256 MiB of float32 logits (a power of two of tokens, at least 64)


@dataclass(frozen=True)
class HeadInput:
    """What the head would have multiplied: its weight ([vocab, d], or [d, vocab] when transposed), bias, the matmul's
    dtype (autocast's where it was on) and the tokens per chunk (0: the whole micro-batch, fused, its logits kept)."""

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
    y = gemm.linear(x, w, b) if not head.transposed else gemm.linear_transposed(x, w, b)
    return y.float()


def _exp_sums(logits: torch.Tensor, targets: torch.Tensor, split: VocabSplit | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: the (full vocabulary's) maximum logit, and [sum of exp(logit - maximum), the target's logit (0 for an
    ignored target)]. Turns `logits` into exp(logits - maximum) in place (one [tokens, vocab] buffer, no temporaries of
    its size); `logits` may be a transposed view ([vocab, tokens] storage)."""
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
    return peak, sums


def _chunk_stats(logits: torch.Tensor, targets: torch.Tensor, split: VocabSplit | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: log-sum-exp over the (full) vocabulary and the target's logit (0 for an ignored target). Consumes
    `logits` (exponentiated in place)."""
    peak, sums = _exp_sums(logits, targets, split)
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
                grad_h[at : at + head.chunk] = gemm.mm(g, w.t() if head.transposed else w)
            if grad_w is not None:  # in place, by the BLAS: oneDNN cannot accumulate, and chunks avoid weight-sized temporaries
                _accumulate(grad_w, *((x.to(head.dtype).t(), g) if head.transposed else (g.t(), x.to(head.dtype))))
            if grad_b is not None:
                grad_b += g.float().sum(0)
            del g  # before the next chunk's logits: one chunk's at a time
        return grad_h, _cast(grad_w, weight), _cast(grad_b, bias), None, None, None


def _logits_t(h: torch.Tensor, head: HeadInput) -> torch.Tensor:
    """The logits transposed, [vocab, tokens] in float32: W h^T (+ b) in the head's dtype. The same products as
    F.linear's h W^T, in the operand order whose output is vocabulary-major: on the CPU it ran at 0.98 of the 2048^3
    matmul rate against 0.85 for h W^T on the gpt2-124m head (docs/performance.md)."""
    w = head.weight.to(head.dtype)
    w = w.t() if head.transposed else w  # [vocab, d]
    x = h.to(head.dtype).t()
    y = gemm.mm(w, x)
    return (y if head.bias is None else y.add_(head.bias.to(head.dtype).unsqueeze(1))).float()


def _scaled_softmax_minus_target(
    exps: torch.Tensor, sums: torch.Tensor, targets: torch.Tensor, split: VocabSplit | None, scale: torch.Tensor
) -> torch.Tensor:
    """scale x d(summed loss)/d(logits), in `exps`' storage: exps holds exp(logits - max) and `sums` their sums over the
    full vocabulary, so the softmax is exps / sums; zero rows for ignored targets and padding columns."""
    start, real = (0, exps.shape[1]) if split is None else (split.start, split.real)
    grad = exps.mul_((scale / sums).unsqueeze(1))
    if real < grad.shape[1]:
        grad[:, real:] = 0.0
    mine = (targets >= start) & (targets < start + real)
    rows = torch.arange(grad.shape[0], device=grad.device)[mine]
    grad[rows, targets[mine] - start] -= scale
    return grad.masked_fill_((targets == IGNORE_INDEX).unsqueeze(1), 0.0)


class LinearCrossEntropy(torch.autograd.Function):
    """Summed token cross-entropy of h W^T + b over a whole micro-batch, fused: the logits are computed once,
    exponentiated in place in forward and kept as the one buffer that backward turns, in place again, into the logits'
    gradient. Against F.linear + F.cross_entropy: the faster operand order, no log-softmax copy, no one-hot or
    softmax-gradient buffers, and no recomputation (the chunked loss's price). The logits' layout follows the product
    library: vocabulary-major ([vocab, tokens], `_logits_t`) on the BLAS, token-major by oneDNN, whose three head
    products ran 1.45 s against 1.95 s vocabulary-major on the gpt2-124m head at 2 threads (docs/performance.md)."""

    @staticmethod
    def forward(
        ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, head: HeadInput, split: VocabSplit | None
    ) -> torch.Tensor:
        view = HeadInput(weight, bias, head.transposed, head.dtype, head.chunk)
        token_major = gemm.takes_onednn(h.to(head.dtype), weight.to(head.dtype))
        exps = _logits(h, view) if token_major else _logits_t(h, view).t()  # [tokens, vocab], a transposed view or not
        peak, sums = _exp_sums(exps, targets, split)
        total = (torch.log(sums[0]) + peak - sums[1]).masked_fill(targets == IGNORE_INDEX, 0.0).sum()
        ctx.save_for_backward(h, weight, bias, targets, exps, sums[0])
        ctx.head, ctx.split, ctx.spent, ctx.token_major = head, split, False, token_major
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.spent:
            raise RuntimeError("the fused head + loss ran backward twice (retain_graph): its kept logits became the gradient in place")
        ctx.spent = True
        h, weight, bias, targets, exps, sums = ctx.saved_tensors
        head, (want_h, want_w, want_b) = ctx.head, ctx.needs_input_grad[:3]
        g = _scaled_softmax_minus_target(exps, sums, targets, ctx.split, grad).to(head.dtype)  # [tokens, vocab]
        w, x = weight.to(head.dtype), h.to(head.dtype)
        grad_h = gemm.mm(g, w.t() if head.transposed else w) if want_h else None
        grad_w = None
        if want_w and ctx.token_major:  # x^T g [d, vocab]: oneDNN's faster order for token-major logits (measured);
            grad_w = gemm.mm(x.t(), g)  # returned as its transposed view: made contiguous (if at all) where it is
            grad_w = grad_w if head.transposed else grad_w.t()  # accumulated, after the logits' buffer is freed
        elif want_w:
            grad_w = gemm.mm(g.t(), x)  # [vocab, d] from vocabulary-major storage
            grad_w = grad_w.t().contiguous() if head.transposed else grad_w
        grad_b = g.float().sum(0) if want_b else None
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
    """Summed token cross-entropy (float32) of a deferred head's output against `targets`: in chunks that never hold the
    whole logits, or (chunk 0) fused over the whole micro-batch, its logits kept."""
    head = head_input_of(out)
    if head is None:
        raise TypeError("chunked_cross_entropy_sum takes a deferred head's output (ChunkedHead.deferred)")
    h = out.reshape(-1, out.shape[-1])
    fn = LinearCrossEntropy if head.chunk == 0 else ChunkedLinearCrossEntropy
    return fn.apply(h, head.weight, head.bias, targets.reshape(-1), head, split)


Projection = Callable[[], tuple[torch.Tensor, torch.Tensor | None, bool]]  # () -> (weight, bias, transposed), read at call time


class ChunkedHead:
    """Switches a model's logits projection between computing logits and, inside `deferred()`, leaving its input
    (marked with a `HeadInput`) for the chunked loss. Installed on the instance: parameter names and hooks stay."""

    def __init__(self, owner: nn.Module, method: str, params: Projection, loss_chunk: int, fuse: bool = True) -> None:
        self.owner, self.method, self.params, self.loss_chunk = owner, method, params, loss_chunk
        self.fuse = fuse  # a micro-batch below the chunking size: fused (True) or the plain projection and loss
        self.active = False
        plain = getattr(owner, method)

        def project(x: torch.Tensor) -> torch.Tensor:
            if not self.active:
                return plain(x)
            weight, bias, transposed = self.params()
            chunk = chunk_tokens(self.loss_chunk, x.numel() // x.shape[-1], weight.shape[1 if transposed else 0])
            if chunk is None and not self.fuse:
                return plain(x)
            out = x.view_as(x)
            setattr(out, HEAD_INPUT, HeadInput(weight, bias, transposed, _matmul_dtype(x, weight), chunk or 0))
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
