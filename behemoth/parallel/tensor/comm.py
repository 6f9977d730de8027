"""The collectives of tensor and sequence parallelism, as autograd functions (Megatron's f and g).

    copy_to_tp         forward: identity        backward: all-reduce       (f: enters a column-parallel region)
    reduce_from_tp     forward: all-reduce      backward: identity         (g: leaves a row-parallel region)
    gather_seq         forward: all-gather      backward: reduce-scatter   (f with sequence parallelism)
    reduce_scatter_seq forward: reduce-scatter  backward: all-gather       (g with sequence parallelism)
    scatter_seq        forward: keep own chunk  backward: all-gather       (enters the sequence-parallel region)

Activations are [batch, sequence, hidden]; the sequence is dimension 1. c10d gathers along dimension 0,
so a sequence collective moves the sequence to the front and back. Every collective goes through
`behemoth.comm`, so its traffic is counted by the run's CommMeter.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from behemoth.comm import CommMeter, all_gather, all_reduce, reduce_scatter

SEQ_DIM = 1
_DEFERRED = threading.local()


@contextlib.contextmanager
def collectives_deferred() -> Iterator[None]:
    """Inside: f is the identity both ways and a row-parallel layer returns its partial sum without bias; the caller
    (sub-pipelined tensor parallelism, subbatch.py) issues those all-reduces itself."""
    before = getattr(_DEFERRED, "on", False)
    _DEFERRED.on = True
    try:
        yield
    finally:
        _DEFERRED.on = before


def deferred() -> bool:
    return getattr(_DEFERRED, "on", False)


@dataclass(frozen=True)
class TPComm:
    """The tensor-parallel process group, this rank's place in it and the meter its traffic goes to."""

    group: dist.ProcessGroup
    size: int
    rank: int
    meter: CommMeter | None = None

    @classmethod
    def of(cls, group: dist.ProcessGroup, meter: CommMeter | None = None) -> TPComm:
        return cls(group, dist.get_world_size(group), dist.get_rank(group), meter)

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """Reduce `t` in place over the group (sum unless `op` says otherwise)."""
        all_reduce(t, self.group, self.meter, op=op)
        return t


class SequenceGather:
    """The all-gather of every rank's sequence shard, in flight: [B, T/t, ...] -> [B, T, ...] when `result()` is asked.

    The shards are gathered rank-major into one buffer ([t, B, T/t, ...], no copy on the way in) and laid out along the
    sequence by one copy on the way out."""

    def __init__(self, x: torch.Tensor, tp: TPComm) -> None:
        self.local, self.tp = x.contiguous(), tp  # kept until the gather is done
        self.out = self.local.new_empty((tp.size * self.local.shape[0], *self.local.shape[1:]))
        self.pending = all_gather(self.out, self.local, tp.group, tp.meter, async_op=True)

    def result(self) -> torch.Tensor:
        self.pending.wait()
        b, rest = self.local.shape[0], self.local.shape[1:]
        ranked = self.out.view(self.tp.size, b, *rest).movedim(0, SEQ_DIM)  # [B, t, T/t, ...]
        return ranked.reshape(b, self.tp.size * rest[0], *rest[1:])


def gather_sequence(x: torch.Tensor, tp: TPComm) -> torch.Tensor:
    """Concatenate every rank's sequence shard: [B, T/t, ...] -> [B, T, ...]."""
    return SequenceGather(x, tp).result()


def reduce_scatter_sequence(x: torch.Tensor, tp: TPComm) -> torch.Tensor:
    """Sum over ranks and keep this rank's sequence shard: [B, T, ...] -> [B, T/t, ...] (one copy, into rank-major order)."""
    b, t, shard = x.shape[0], tp.size, x.shape[SEQ_DIM] // tp.size
    ranked = x.reshape(b, t, shard, *x.shape[2:]).movedim(1, 0).contiguous()  # [t, B, T/t, ...]
    out = x.new_empty((b, shard, *x.shape[2:]))
    reduce_scatter(out, ranked.view(t * b, shard, *x.shape[2:]), tp.group, tp.meter)
    return out


SeqOp = Callable[[torch.Tensor, TPComm], torch.Tensor]


def split_sequence(x: torch.Tensor, tp: TPComm) -> torch.Tensor:
    """This rank's shard of the sequence (no communication)."""
    return x.chunk(tp.size, dim=SEQ_DIM)[tp.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPComm) -> torch.Tensor:
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.tp.all_reduce(grad.contiguous().clone()), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPComm) -> torch.Tensor:
        """Sums the partial products in place: they are a fresh product that nothing else holds (marked dirty)."""
        if not x.is_contiguous():
            return tp.all_reduce(x.contiguous())
        ctx.mark_dirty(x)
        return tp.all_reduce(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _SequenceConjugate(torch.autograd.Function):
    """A sequence-parallel boundary: `forward_op` on the activation, its conjugate `backward_op` on the gradient
    (all-gather <-> reduce-scatter; keeping this rank's shard <-> all-gather)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPComm, forward_op: SeqOp, backward_op: SeqOp) -> torch.Tensor:
        ctx.tp, ctx.backward_op = tp, backward_op
        return forward_op(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.backward_op(grad, ctx.tp), None, None, None


@torch.compiler.disable  # opaque to torch.compile: a graph break, no guards on the meter's counters
def copy_to_tp(x: torch.Tensor, tp: TPComm) -> torch.Tensor:
    """f: identity forward, all-reduce of the input gradient backward (the caller's, where collectives are deferred)."""
    return x if deferred() else _CopyToTP.apply(x, tp)


@torch.compiler.disable
def reduce_from_tp(x: torch.Tensor, tp: TPComm) -> torch.Tensor:
    """g: all-reduce forward (partial sums become the full sum), identity backward. In place: pass a fresh product
    that nothing else reads."""
    return _ReduceFromTP.apply(x, tp)


@torch.compiler.disable
def gather_seq(x: torch.Tensor, tp: TPComm) -> torch.Tensor:
    """f under sequence parallelism: all-gather the sequence forward, reduce-scatter backward."""
    return _SequenceConjugate.apply(x, tp, gather_sequence, reduce_scatter_sequence)


@torch.compiler.disable
def reduce_scatter_seq(x: torch.Tensor, tp: TPComm) -> torch.Tensor:
    """g under sequence parallelism: reduce-scatter the sequence forward, all-gather backward."""
    return _SequenceConjugate.apply(x, tp, reduce_scatter_sequence, gather_sequence)


@torch.compiler.disable
def gather_seq_whole(x: torch.Tensor, tp: TPComm) -> torch.Tensor:
    """Leave the sequence-parallel region for a consumer that computes whole on every tp rank (an MoE layer: its
    router is replicated and its experts enter the tensor-parallel region themselves): all-gather the sequence forward;
    backward, the input gradient is complete on every rank, so each keeps its shard of it."""
    return _SequenceConjugate.apply(x, tp, gather_sequence, split_sequence)


@torch.compiler.disable
def scatter_seq(x: torch.Tensor, tp: TPComm) -> torch.Tensor:
    """Enter the sequence-parallel region: keep this rank's shard forward, all-gather backward."""
    return _SequenceConjugate.apply(x, tp, split_sequence, gather_sequence)
