"""Flat parameter groups for ZeRO stages 1 and 2: full replicated parameters, sharded optimizer work.

Every group (a bucket of about `bucket_mb`, filled in backward order) keeps its parameters as views
into one flat buffer, so the all-gather after the optimizer step writes all of them at once. Its
gradients are reduce-scattered: rank r receives the sum of elements [r * S, (r + 1) * S), the shard
whose master weights and Adam moments it alone keeps.

- stage 1 (`AccumulatingBucket`): gradients are views into a persistent full-size flat buffer (as in
  data parallelism); on the last micro-batch each bucket is reduce-scattered in place as soon as
  backward fills it.
- stage 2 (`StreamingBucket`): no full-size gradient is kept. Each parameter's gradient is added into
  its bucket as backward produces it and dropped; a full bucket is reduce-scattered, added into the
  persistent gradient shard and freed. This runs on every micro-batch, so a full gradient never exists.
"""

from __future__ import annotations

import abc
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from behemoth.comm import CommMeter, Pending, all_gather, reduce_scatter
from behemoth.parallel.zero.layout import FlatLayout


class BufferMeter:
    """Bytes of short-lived buffers whose storage is really still alive, and their peak.

    Memory only grows when a buffer is allocated, so the peak is taken at each `add`, over every
    buffer whose storage has not been freed yet (a weak reference to the storage itself, so a
    forgotten view or a saved tensor that keeps a buffer alive is counted). A buffer its owner has
    `drop`ped may still be held for a moment by the communication thread of a collective that has
    just finished with it (gloo releases its tensors after `wait` returns); the meter gives such
    buffers up to `SETTLE_S` to go before it counts them, so the peak is behemoth's, not a race.

    That wait has no place on the training path: a meter counts only once `measure()` switched it on
    (`ParallelModel.measure_buffers`, which the memory measurements call); until then `add` and `drop` do nothing.
    """

    SETTLE_S = 0.05

    def __init__(self) -> None:
        self.live: list[tuple[StorageWeakRef, int]] = []
        self.dropped: list[StorageWeakRef] = []
        self.peak = 0
        self.measuring = False

    def measure(self) -> None:
        """Count from now on."""
        self.measuring = True

    def add(self, t: torch.Tensor) -> None:
        if self.measuring:
            self.live.append((StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
            self.peak = max(self.peak, self.sample())

    def drop(self, t: torch.Tensor) -> None:
        """The owner lets go of `t` (the caller's own references go right after)."""
        if self.measuring:
            self.dropped.append(StorageWeakRef(t.untyped_storage()))

    def sample(self) -> int:
        """Bytes alive now (forgets freed buffers)."""
        deadline = time.perf_counter() + self.SETTLE_S
        while any(not ref.expired() for ref in self.dropped) and time.perf_counter() < deadline:
            time.sleep(0)  # let the collective's thread run
        self.dropped = []
        self.live = [(ref, n) for ref, n in self.live if not ref.expired()]
        return sum(n for _, n in self.live)


class FlatGroup(abc.ABC):
    """Parameters laid out in one padded flat buffer; this rank's shard of their master weights and gradients."""

    master: torch.Tensor  # float32 master weights of this rank's shard (may alias the compute parameters)
    grad_shard: torch.Tensor  # summed gradient of this rank's shard, in the compute dtype

    def __init__(
        self, names: list[str], shapes: list[tuple[int, ...]], group: dist.ProcessGroup, *, compute_dtype: torch.dtype, meter: CommMeter | None
    ) -> None:
        self.group, self.meter, self.compute_dtype = group, meter, compute_dtype
        self.rank = dist.get_rank(group)
        self.layout = FlatLayout(names, shapes, dist.get_world_size(group))
        self.lo, self.hi = self.layout.shard_range(self.rank)

    @abc.abstractmethod
    def publish(self) -> Pending | None:
        """After the optimizer step: make the compute parameters equal the master weights."""

    def zero_grad(self) -> None:
        self.grad_shard.zero_()

    def new_micro_batch(self) -> None:
        """Forget per-micro-batch bookkeeping (stage 3 keeps none)."""


class ReplicatedGroup(FlatGroup):
    """A bucket of full parameters (ZeRO-1/2) whose gradients are reduce-scattered to shard owners.

    The two stages differ only in where a gradient lives until it is reduced: `AccumulatingBucket` (stage 1)
    keeps a full gradient buffer for the whole step; `StreamingBucket` (stage 2) keeps only the shard."""

    def __init__(
        self,
        params: list[nn.Parameter],
        names: list[str],
        group: dist.ProcessGroup,
        *,
        compute_dtype: torch.dtype,
        meter: CommMeter | None,
        buffers: BufferMeter,
    ) -> None:
        super().__init__(names, [tuple(p.shape) for p in params], group, compute_dtype=compute_dtype, meter=meter)
        self.params, self.buffers = params, buffers
        self.device = params[0].device
        flat32 = torch.zeros(self.layout.padded, dtype=torch.float32, device=self.device)
        for p, offset, n in zip(params, self.layout.offsets, self.layout.numels):
            flat32[offset : offset + n].copy_(p.detach().reshape(-1))
        self.separate_master = compute_dtype != torch.float32  # with float32 compute the shard of `full` is the master
        self.full = flat32.to(compute_dtype) if self.separate_master else flat32
        self.master = flat32[self.lo : self.hi].clone() if self.separate_master else self.full[self.lo : self.hi]
        del flat32
        for p, view in zip(params, self.views(self.full)):
            p.data = view
        self.grad_full: torch.Tensor | None = None  # the bucket's full gradient, while it exists
        self.ready = 0  # gradients produced in this backward
        self.sent = False  # reduce-scatter issued in this micro-batch
        self.pending: Pending | None = None

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's shaped view into a flat buffer of this group's layout."""
        return [flat[o : o + n].view(s) for o, n, s in zip(self.layout.offsets, self.layout.numels, self.layout.shapes)]

    def reduce_scatter_grads(self) -> None:
        """Start summing the bucket over ranks; this rank's shard lands in place, in its own slice."""
        if self.sent:
            return
        self.sent = True
        if self.grad_full is None:  # a stage-2 bucket that received no gradient: contribute zeros
            self.grad_full = torch.zeros(self.layout.padded, dtype=self.compute_dtype, device=self.device)
            self.buffers.add(self.grad_full)
        self.pending = reduce_scatter(self.grad_full[self.lo : self.hi], self.grad_full, self.group, self.meter, async_op=True)

    def wait(self) -> None:
        """Finish the reduce-scatter."""
        if self.pending is not None:
            self.pending.wait()
            self.reduced()
        self.pending = None

    def reduced(self) -> None:
        """This rank's slice of `grad_full` holds the summed shard."""

    def new_micro_batch(self) -> None:
        self.ready, self.sent = 0, False

    def publish(self) -> Pending | None:
        if self.separate_master:
            self.full[self.lo : self.hi].copy_(self.master)
        return all_gather(self.full, self.full[self.lo : self.hi], self.group, self.meter, async_op=True)


class AccumulatingBucket(ReplicatedGroup):
    """ZeRO-1: gradients are views into a full-size flat buffer kept for the step (as in data parallelism); on the
    last micro-batch the bucket is reduce-scattered in place, and the shard is a view of its own slice."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.grad_full = torch.zeros(self.layout.padded, dtype=self.compute_dtype, device=self.device)
        for p, view in zip(self.params, self.views(self.grad_full)):
            p.grad = view
        self.grad_shard = self.grad_full[self.lo : self.hi]

    def zero_grad(self) -> None:
        self.grad_full.zero_()


class StreamingBucket(ReplicatedGroup):
    """ZeRO-2: no full-size gradient is kept. Each gradient is added into a bucket as backward produces it and dropped;
    a full bucket is reduce-scattered, its shard added into the persistent one and the bucket freed, on every
    micro-batch, so a full gradient never outlives one."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.grad_shard = torch.zeros(self.layout.shard_size, dtype=self.compute_dtype, device=self.device)

    def take_grad(self, p: nn.Parameter, index: int) -> None:
        """Add a freshly produced gradient into the bucket (allocated, zeroed, on first use) and drop it.
        Added, not copied: a bucket that some parameter left incomplete in an earlier micro-batch is still unsent."""
        if self.grad_full is None:
            self.grad_full = torch.zeros(self.layout.padded, dtype=self.compute_dtype, device=self.device)
            self.buffers.add(self.grad_full)
        offset, n = self.layout.offsets[index], self.layout.numels[index]
        self.grad_full[offset : offset + n].add_(p.grad.reshape(-1))
        p.grad = None

    def take_grads(self) -> None:
        """Take every gradient a pass left in `.grad` (a pipeline's, or one kept until the step)."""
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self.take_grad(p, i)

    def reduced(self) -> None:
        self.grad_shard.add_(self.grad_full[self.lo : self.hi])
        self.buffers.drop(self.grad_full)
        self.grad_full = None
