"""Data parallelism: gradients all-reduced in buckets as soon as backward fills each bucket.

Every parameter's `.grad` is a view into a flat bucket buffer, so autograd accumulates straight
into the buffer and the all-reduce needs no copy. A post-accumulate-grad hook counts ready
gradients; when a bucket is complete its all-reduce is launched asynchronously and the rest of
backward runs while it travels. On gradient-accumulation micro-steps nothing is sent.

The loss is already divided by the global token count (see `engine.py`), so the all-reduce sums.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from behemoth.comm import CommMeter, Pending, all_reduce, plan_buckets
from behemoth.parallel.clip import clip_grad_norm


class GradBucket:
    """A flat gradient buffer shared by a few parameters, and its in-flight all-reduce."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        dtype, device = params[0].dtype, params[0].device
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        offset = 0
        for p in params:
            p.grad = self.buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready = 0
        self.pending: Pending | None = None


class DataParallel:
    """Keeps data-parallel replicas' gradients equal: the sum over ranks, overlapped with backward."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, *, bucket_bytes: int, meter: CommMeter | None = None) -> None:
        self.group, self.meter = group, meter
        self.world = dist.get_world_size(group)
        self.params = [p for p in params if p.requires_grad]
        self.buckets = [GradBucket(b) for b in plan_buckets(reversed(self.params), bucket_bytes)]
        self.sync = True
        for bucket in self.buckets if self.world > 1 else []:  # one replica: nothing to reduce, no hooks
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self._ready_hook(bucket))

    def _ready_hook(self, bucket: GradBucket):
        def hook(_: torch.Tensor) -> None:
            if not self.sync:
                return
            bucket.ready += 1
            if bucket.ready == len(bucket.params):
                self._launch(bucket)
        return hook

    def _launch(self, bucket: GradBucket) -> None:
        if bucket.pending is None:  # (a group of one: comm.all_reduce returns at once)
            bucket.pending = all_reduce(bucket.buffer, self.group, self.meter, async_op=True)

    def set_sync(self, enabled: bool) -> None:
        """Communicate during the next backward (the last micro-step) or not (accumulation)."""
        self.sync = enabled

    def finish(self) -> None:
        """Wait for every bucket; buckets with unused parameters are reduced here, in a fixed order."""
        for bucket in self.buckets:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.pending is not None:
                bucket.pending.wait()
            bucket.pending, bucket.ready = None, 0

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.zero_()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient norm (gradients are replicated, so the local norm is global); clip if > 0."""
        return clip_grad_norm([("", b.buffer) for b in self.buckets], max_norm)

    def grad_bytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)


def apply_data_parallel(model: nn.Module, dp_group: dist.ProcessGroup, *, bucket_mb: float, meter: CommMeter | None = None) -> DataParallel:
    """Attach bucketed, overlapped gradient all-reduce to `model`'s parameters."""
    return DataParallel(list(model.parameters()), dp_group, bucket_bytes=int(bucket_mb * 2**20), meter=meter)
