"""Megatron-style parallel layers: column- and row-parallel linear, vocabulary-parallel embedding and
cross-entropy. Each holds this rank's part of a parameter of the single-process model.

A `ShardLayout` says which part: pieces along one dimension of the full tensor. A fused [q|k|v] weight
is split per segment, so each rank keeps whole heads of q, k and v (three pieces); a vocabulary that
t does not divide is padded to t x ceil(V / t) rows, the padding rows are zero, never looked up, and
their logits are masked out of the softmax, so the loss is the single-process loss.

Under sequence parallelism a column layer keeps only the sequence shard of its all-gathered input and
gathers it again in backward for its weight gradient (one gather per norm, shared by q, k and v), as
Megatron-LM does, so everything a block saves divides by t (see activations.py).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from behemoth.errors import BehemothError
from behemoth.models import gemm
from behemoth.models.causal_lm import IGNORE_INDEX
from behemoth.models.init import FULL_NAME, mark_partial
from behemoth.parallel.chunked import Box
from behemoth.parallel.deferred import DeferralSlot, accumulate, deferrable_linear
from behemoth.parallel.tensor.comm import SequenceGather, TPComm, copy_to_tp, deferred, gather_seq, reduce_from_tp, reduce_scatter_seq

TP_LAYOUT = "_behemoth_tp_layout"  # ShardLayout of a tensor-parallel parameter
TP_PARTIAL_GRAD = "_behemoth_tp_partial_grad"  # replicated parameter whose gradient is a partial sum over tp
SEQ_SOURCE = "_behemoth_seq_source"  # on an all-gathered activation (SP): (its sequence shard, the shared RegatherCache)


@dataclass(frozen=True)
class ShardLayout:
    """This rank's part of a full tensor: `pieces` (full start, local start, length) along `dim`."""

    full_shape: tuple[int, ...]
    dim: int
    local_size: int
    pieces: tuple[tuple[int, int, int], ...]

    @classmethod
    def split(cls, name: str, full_shape: tuple[int, ...], dim: int, tp: TPComm, parts: int = 1) -> ShardLayout:
        """Each of `parts` equal fused segments split evenly over the ranks."""
        n = full_shape[dim]
        if n % parts or (n // parts) % tp.size:
            raise BehemothError(
                f"{name}: dimension {dim} of size {n} ({parts} fused part(s)) does not split over tp={tp.size}",
                f"choose a tp that divides {n // parts}",
            )
        seg, chunk = n // parts, n // parts // tp.size
        pieces = tuple((p * seg + tp.rank * chunk, p * chunk, chunk) for p in range(parts))
        return cls(tuple(full_shape), dim, parts * chunk, pieces)

    @classmethod
    def padded(cls, full_shape: tuple[int, ...], dim: int, tp: TPComm) -> ShardLayout:
        """Rows [r*c, (r+1)*c) with c = ceil(n / t); rows past n are padding."""
        n = full_shape[dim]
        chunk = math.ceil(n / tp.size)
        start = min(n, tp.rank * chunk)
        length = min(n, start + chunk) - start
        return cls(tuple(full_shape), dim, chunk, ((start, 0, length),) if length else ())

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.dim] = self.local_size
        return tuple(shape)

    def boxes(self) -> list[Box]:
        """The part as boxes of the full tensor and of the local one: one per piece along `dim` (padding rows none)."""
        out = []
        for start, local, length in self.pieces:
            full, loc, size = [0] * len(self.full_shape), [0] * len(self.full_shape), list(self.full_shape)
            full[self.dim], loc[self.dim], size[self.dim] = start, local, length
            out.append((tuple(full), tuple(loc), tuple(size)))
        return out

    def take_local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor (padding rows zero)."""
        out = full.new_zeros(self.local_shape)
        for start, local, length in self.pieces:
            out.narrow(self.dim, local, length).copy_(full.narrow(self.dim, start, length))
        return out


class PartLayout(Protocol):
    """What a parameter's part needs of its layout: a 1-D split (`ShardLayout`) or a 2-D/3-D block (`summa.BlockLayout`)."""

    @property
    def full_shape(self) -> tuple[int, ...]: ...

    @property
    def local_shape(self) -> tuple[int, ...]: ...

    def take_local(self, full: torch.Tensor) -> torch.Tensor: ...


def shard_parameter(param: nn.Parameter, full_name: str, layout: PartLayout) -> nn.Parameter:
    """A parameter holding `layout`'s part of `param`; on the meta device `materialize` fills it later (drawing the full
    tensor from (seed, name) and keeping the part)."""
    full_name = getattr(param, FULL_NAME, full_name)
    if param.is_meta:
        new = nn.Parameter(torch.empty(layout.local_shape, dtype=param.dtype, device="meta"), requires_grad=param.requires_grad)
        mark_partial(new, full_name, layout.full_shape, layout.take_local)
    else:
        new = nn.Parameter(layout.take_local(param.detach()), requires_grad=param.requires_grad)
    setattr(new, FULL_NAME, full_name)
    setattr(new, TP_LAYOUT, layout)
    return new


def enter_tp_region(x: torch.Tensor, tp: TPComm, sequence_parallel: bool) -> torch.Tensor:
    """Make `x` the input of column-parallel layers: f, or the all-gather of the sequence under SP.

    Under SP the gathered tensor remembers the shard it came from, so the column layers that read it save
    the shard (1/t of it) for their weight gradient and gather it again in backward, as Megatron-LM does.
    """
    if not sequence_parallel:
        return copy_to_tp(x, tp)
    full = gather_seq(x, tp)
    if torch.is_grad_enabled():
        setattr(full, SEQ_SOURCE, (x, RegatherCache(tp)))
    return full


class RegatherCache:
    """The backward all-gather of one saved sequence shard, shared by every column layer that read it (q, k, v:
    one gather, not three). It holds no tensor until backward, is started by the first input-gradient pass that
    reaches it (so the gather travels while that pass multiplies) and drops the gathered tensor after its last reader."""

    def __init__(self, tp: TPComm) -> None:
        self.tp, self.readers, self.full = tp, 0, None
        self.gather: SequenceGather | None = None

    def start(self, shard: torch.Tensor) -> None:
        """Issue the all-gather now, if a weight gradient will need it and it is not on its way already."""
        if self.readers > 0 and self.full is None and self.gather is None:
            self.gather = SequenceGather(shard, self.tp)

    def take(self, shard: torch.Tensor) -> torch.Tensor:
        if self.full is None:
            self.start(shard)
            self.full, self.gather = self.gather.result(), None
        full = self.full
        self.readers -= 1
        if self.readers <= 0:
            self.full = None
        return full


class _InputPath(torch.autograd.Function):
    """x W^T with the weight out of the graph (passed in a tuple): backward gives the input gradient only, after
    starting the weight path's re-gather of the sequence shard (when there is one) so the two overlap.

    The weight is saved as an intermediate, so saved-tensor hooks (ZeRO-3's re-gather) see the parameter itself."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight_and_more: tuple[torch.Tensor, bool, RegatherCache | None, torch.Tensor | None, DeferralSlot | None]
    ) -> torch.Tensor:
        weight, ctx.transposed, ctx.cache, ctx.shard, ctx.slot = weight_and_more
        ctx.save_for_backward(weight)
        ctx.x_dtype = x.dtype
        return local_linear(x, weight, None, ctx.transposed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        deferring = ctx.slot is not None and ctx.slot.queue is not None  # the gather then waits for the weight pass
        if ctx.cache is not None and not deferring:
            ctx.cache.start(ctx.shard)
        (weight,) = ctx.saved_tensors
        weight = weight.to(grad.dtype)
        return gemm.matmul(grad, weight.t() if ctx.transposed else weight).to(ctx.x_dtype), None


class _WeightPath(torch.autograd.Function):
    """Forward: the bias broadcast to the output (zeros without one). Backward: the weight and bias gradients,
    from the saved sequence shard gathered again; deferred to the weight pass when the slot holds a queue (a
    zero-bubble schedule's input pass), so that pass neither gathers nor multiplies for the weights."""

    @staticmethod
    def forward(
        ctx,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        shard: torch.Tensor,
        cache: RegatherCache,
        shape: torch.Size,
        dtype: torch.dtype,
        transposed: bool,
        slot: DeferralSlot | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(shard)
        ctx.cache, ctx.transposed, ctx.slot = cache, transposed, slot
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        # the Parameters themselves only where a weight pass may add into their .grad: a reference held until backward
        # would keep a ZeRO-3 unit's gathered buffer alive (the weight is a view of it there)
        ctx.params = (weight, bias) if slot is not None else None
        return (weight.new_zeros((), dtype=dtype) if bias is None else bias.to(dtype)).expand(shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (shard,) = ctx.saved_tensors
        wants = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        if ctx.slot is not None and ctx.slot.queue is not None:
            weight, bias = ctx.params
            ctx.slot.queue.defer(functools.partial(_regathered_weight_grads, ctx.cache, shard, grad, ctx.transposed, weight, bias, wants))
            return None, None, None, None, None, None, None, None
        grad_w, grad_b = regathered_weight_grads(ctx.cache, shard, grad, ctx.transposed, ctx.dtypes, wants)
        return grad_w, grad_b, None, None, None, None, None, None


def regathered_weight_grads(
    cache: RegatherCache,
    shard: torch.Tensor,
    grad: torch.Tensor,
    transposed: bool,
    dtypes: tuple[torch.dtype, torch.dtype | None],
    wants: tuple[bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The weight gradient from the re-gathered input and the output gradient, and the bias gradient (as asked)."""
    g = grad.reshape(-1, grad.shape[-1])
    grad_w = grad_b = None
    if wants[0]:
        x = cache.take(shard).to(g.dtype)
        x = x.reshape(-1, x.shape[-1])
        grad_w = (gemm.mm(x.t(), g) if transposed else gemm.mm(g.t(), x)).to(dtypes[0])
    if wants[1]:
        grad_b = g.sum(0).to(dtypes[1])
    return grad_w, grad_b


def _regathered_weight_grads(
    cache: RegatherCache,
    shard: torch.Tensor,
    grad: torch.Tensor,
    transposed: bool,
    weight: nn.Parameter,
    bias: nn.Parameter | None,
    wants: tuple[bool, bool],
) -> None:
    """A deferred weight pass: the same gradients, added into `.grad`."""
    dtypes = (weight.dtype, None if bias is None else bias.dtype)
    for p, g in zip((weight, bias), regathered_weight_grads(cache, shard, grad, transposed, dtypes, wants)):
        if g is not None:
            accumulate(p, g)


def linear_saving_shard(
    x: torch.Tensor,
    shard: torch.Tensor,
    cache: RegatherCache,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transposed: bool,
    slot: DeferralSlot | None = None,
) -> torch.Tensor:
    """x W + b for an all-gathered `x` that autograd does not keep: only its sequence `shard` is saved.

    The weight path's node is made first, so backward runs the input path first (autograd runs the later of two
    ready nodes first): it starts the re-gather, multiplies, and the weight path then finds the gather done."""
    if not (weight.requires_grad or (bias is not None and bias.requires_grad)):
        y = _InputPath.apply(x, (weight, transposed, None, None, None))
        return y if bias is None else y + bias
    if weight.requires_grad:
        cache.readers += 1
    shape, dtype = (*x.shape[:-1], weight.shape[1] if transposed else weight.shape[0]), matmul_dtype(x, weight)
    weight_part = _WeightPath.apply(weight, bias, shard.detach(), cache, shape, dtype, transposed, slot)
    return _InputPath.apply(x, (weight, transposed, cache, shard.detach(), slot)) + weight_part


def matmul_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of x @ W: autocast's where it is on, else the promoted one."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else torch.promote_types(x.dtype, weight.dtype)


def local_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """x W^T + b for an nn.Linear weight [out, in]; x W + b for a transposed weight [in, out] (by the process's
    train.gemm library: models/gemm.py)."""
    return gemm.linear_transposed(x, weight, bias) if transposed else gemm.linear(x, weight, bias)


def check_linear(module: nn.Module, name: str, transposed: bool) -> None:
    """Column/row-parallel styles split a linear layer: nn.Linear ([out, in]) or one its model marks as transposed
    ([in, out]: `CausalLM.transposed`)."""
    if not (transposed or isinstance(module, nn.Linear)) or getattr(module, "weight", None) is None:
        raise BehemothError(
            f"{name} is a {type(module).__name__}; column/row-parallel styles apply to linear layers",
            "map this module to another style in the tensor-parallel plan",
        )


class ColumnParallelLinear(nn.Module):
    """Y_r = X A_r + b_r: this rank's output features; the output stays split over tp.

    X must already be in the tensor-parallel region (`enter_tp_region`, done once by the norm before the
    layer, so q, k and v share one all-reduce / all-gather instead of three). Under SP the layer keeps only
    X's sequence shard for backward (`linear_saving_shard`), so the saved activations divide by t.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, *, transposed: bool, tp: TPComm, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.transposed, self.tp, self.sequence_parallel = transposed, tp, sequence_parallel
        self.deferral: DeferralSlot | None = None  # set under a split backward: weight gradients wait for the weight pass

    @classmethod
    def from_module(
        cls, module: nn.Module, name: str, tp: TPComm, *, sequence_parallel: bool, transposed: bool = False, parts: int = 1, padded: bool = False
    ) -> ColumnParallelLinear:
        check_linear(module, name, transposed)
        dim = 1 if transposed else 0
        w = module.weight
        layout = ShardLayout.padded(tuple(w.shape), dim, tp) if padded else ShardLayout.split(f"{name}.weight", tuple(w.shape), dim, tp, parts)
        bias = getattr(module, "bias", None)
        if bias is not None:
            bias_layout = ShardLayout(tuple(bias.shape), 0, layout.local_size, layout.pieces)
            bias = shard_parameter(bias, f"{name}.bias", bias_layout)
        return cls(shard_parameter(w, f"{name}.weight", layout), bias, transposed=transposed, tp=tp, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        source = getattr(x, SEQ_SOURCE, None) if self.sequence_parallel and torch.is_grad_enabled() else None
        if source is not None:
            return linear_saving_shard(x, *source, self.weight, self.bias, self.transposed, self.deferral)
        if self.deferral is not None:
            return deferrable_linear(x, self.weight, self.bias, self.deferral, self.transposed)
        return local_linear(x, self.weight, self.bias, self.transposed)


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r A_r + b: input features split over tp, the partial products summed (or reduce-scattered under SP)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, *, transposed: bool, tp: TPComm, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.transposed, self.tp, self.sequence_parallel = transposed, tp, sequence_parallel
        self.deferral: DeferralSlot | None = None  # set under a split backward: weight gradients wait for the weight pass

    @classmethod
    def from_module(cls, module: nn.Module, name: str, tp: TPComm, *, sequence_parallel: bool, transposed: bool = False) -> RowParallelLinear:
        check_linear(module, name, transposed)
        w = module.weight
        layout = ShardLayout.split(f"{name}.weight", tuple(w.shape), 0 if transposed else 1, tp)
        bias = getattr(module, "bias", None)
        if bias is not None and sequence_parallel:  # added to this rank's sequence shard: its gradient is partial
            setattr(bias, TP_PARTIAL_GRAD, True)
        return cls(shard_parameter(w, f"{name}.weight", layout), bias, transposed=transposed, tp=tp, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.deferral is not None:
            y = deferrable_linear(x, self.weight, None, self.deferral, self.transposed)
        else:
            y = local_linear(x, self.weight, None, self.transposed)
        if deferred() and not self.sequence_parallel:  # the caller sums the partial products and adds the bias
            return y
        y = reduce_scatter_seq(y, self.tp) if self.sequence_parallel else reduce_from_tp(y, self.tp)
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class VocabShard:
    """The vocabulary rows this rank holds: [start, start + real) of the full vocabulary, `padded` rows in all."""

    start: int
    real: int
    padded: int

    @classmethod
    def of(cls, layout: ShardLayout) -> VocabShard:
        start, _, real = layout.pieces[0] if layout.pieces else (layout.full_shape[layout.dim], 0, 0)
        return cls(start, real, layout.local_size)


class VocabParallelEmbedding(nn.Module):
    """Each rank looks up the tokens in its vocabulary rows; the partial embeddings are summed over tp (or, with
    `reduce_output` off under SP, left partial for the first block to reduce-scatter). The module's padding row
    (`padding_idx`, the pad token's) gets no gradient from the lookup, as in nn.Embedding."""

    def __init__(self, weight: nn.Parameter, vocab: VocabShard, tp: TPComm, padding_idx: int | None = None) -> None:
        super().__init__()
        self.weight, self.vocab, self.tp = weight, vocab, tp
        self.reduce_output = True
        owned = padding_idx is not None and vocab.start <= padding_idx < vocab.start + vocab.real
        self.local_padding_idx = padding_idx - vocab.start if owned and padding_idx is not None else None

    @classmethod
    def from_module(cls, module: nn.Embedding, name: str, tp: TPComm) -> VocabParallelEmbedding:
        if not isinstance(module, nn.Embedding):
            raise BehemothError(f"{name} is a {type(module).__name__}, not an nn.Embedding", "use the vocab style on embeddings and LM heads")
        layout = ShardLayout.padded(tuple(module.weight.shape), 0, tp)
        return cls(shard_parameter(module.weight, f"{name}.weight", layout), VocabShard.of(layout), tp, module.padding_idx)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.vocab.start) & (ids < self.vocab.start + self.vocab.real)
        out = F.embedding(torch.where(mine, ids - self.vocab.start, 0), self.weight, padding_idx=self.local_padding_idx)
        out = out.masked_fill(~mine.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.tp) if self.reduce_output else out


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Token losses from vocabulary-split logits: two small all-reduces per token, never the full logits."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, vocab: VocabShard, tp: TPComm) -> torch.Tensor:
        real = logits[:, : vocab.real].float()  # the padding columns are masked out here
        peak = real.amax(dim=1) if vocab.real else real.new_full((real.shape[0],), -math.inf)
        tp.all_reduce(peak, dist.ReduceOp.MAX)
        exp = torch.exp(real - peak.unsqueeze(1))
        mine = (targets >= vocab.start) & (targets < vocab.start + vocab.real)
        local_target = torch.where(mine, targets - vocab.start, 0)
        picked = (real.gather(1, local_target.unsqueeze(1)).squeeze(1) - peak) if vocab.real else torch.zeros_like(peak)
        sums = torch.stack([exp.sum(dim=1), picked.masked_fill(~mine, 0.0)])
        tp.all_reduce(sums)
        exp.div_(sums[0].unsqueeze(1))  # softmax, kept for backward
        ignored = targets == IGNORE_INDEX  # a masked target (a chat's prompt): no loss, and a zero softmax row, no gradient
        exp.masked_fill_(ignored.unsqueeze(1), 0.0)
        ctx.save_for_backward(exp, local_target, mine)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return (torch.log(sums[0]) - sums[1]).masked_fill(ignored, 0.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local_target, mine = ctx.saved_tensors
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        softmax[rows[mine], local_target[mine]] -= 1.0
        out = softmax.new_zeros(ctx.shape)
        out[:, : softmax.shape[1]] = softmax * grad.unsqueeze(1)
        return out.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab: VocabShard, tp: TPComm) -> torch.Tensor:
    """Per-token cross-entropy of logits whose last dimension is this rank's vocabulary shard."""
    return _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), vocab, tp)
