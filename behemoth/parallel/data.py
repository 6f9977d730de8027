"""Data parallelism: gradients all-reduced in buckets as soon as backward fills each bucket.

Every parameter's `.grad` is a view into a flat bucket buffer, so autograd accumulates straight
into the buffer and the all-reduce needs no copy. A post-accumulate-grad hook counts ready
gradients; when a bucket is complete its all-reduce is launched asynchronously and the rest of
backward runs while it travels. On gradient-accumulation micro-steps nothing is sent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from behemoth.comm import CommMeter, Pending, all_reduce, plan_buckets
from behemoth.models.causal_lm import tied_names
from behemoth.models.init import FULL_NAME
from behemoth.parallel.sync import AdamWSettings, GradSync, Optimizer, adamw_with_state, decays, with_tied_names


@dataclass(frozen=True)
class DataParallelPolicy:
    """Replicated data parallelism: the size of a gradient bucket (one all-reduce each)."""

    bucket_mb: float = 25.0


class GradBucket:
    """A flat gradient buffer shared by a few parameters, and its in-flight all-reduce."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        dtype, device = params[0].dtype, params[0].device
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
        offset = 0
        for p in params:
            p.grad = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready = 0
        self.pending: Pending | None = None


class ReplicatedAdamW(Optimizer):
    """torch's AdamW over whole parameters, with its state named by single-process parameter names."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], settings: AdamWSettings) -> None:
        self.names = {p: name for name, p in named}
        params = list(self.names)
        self.inner = adamw_with_state([p for p in params if decays(p.shape)], [p for p in params if not decays(p.shape)], settings)
        self.param_groups = self.inner.param_groups if self.inner else []

    def step(self) -> None:
        if self.inner is not None:
            self.inner.step()

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {self.names[p]: dict(state) for p, state in self.inner.state.items()} if self.inner else {}

    def state_bytes(self) -> int:
        states = self.inner.state.values() if self.inner else []
        return sum(t.numel() * t.element_size() for s in states for t in s.values() if torch.is_tensor(t) and t.dim() > 0)


class ReplicatedSync(GradSync):
    """A sync under which every rank holds every parameter whole (`named`, with the tied `aliases`): its gradients,
    optimizer and state are the single-process ones."""

    named: list[tuple[str, nn.Parameter]]
    aliases: dict[str, list[str]]

    def grad_slices(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, p.grad) for name, p in self.named if p.grad is not None]

    def build_optimizer(self, settings: AdamWSettings) -> ReplicatedAdamW:
        return ReplicatedAdamW(self.named, settings)

    def model_state(self) -> dict[str, Any]:
        return with_tied_names({name: p.detach() for name, p in self.named}, self.aliases)

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in self.named)


class DataParallel(ReplicatedSync):
    """Keeps data-parallel replicas' gradients equal: the sum over ranks, overlapped with backward."""

    sharded = False

    def __init__(
        self,
        named: list[tuple[str, nn.Parameter]],
        group: dist.ProcessGroup,
        *,
        bucket_bytes: int,
        aliases: dict[str, list[str]] | None = None,
        meter: CommMeter | None = None,
    ) -> None:
        self.group, self.meter, self.aliases = group, meter, aliases or {}
        self.named = [(getattr(p, FULL_NAME, n), p) for n, p in named if p.requires_grad]
        self.buckets = [GradBucket(b) for b in plan_buckets(reversed([p for _, p in self.named]), bucket_bytes)]
        self.sync = True
        for bucket in self.buckets if dist.get_world_size(group) > 1 else []:  # one replica: nothing to reduce, no hooks
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self._ready_hook(bucket))

    def _ready_hook(self, bucket: GradBucket) -> Callable[[torch.Tensor], None]:
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

    def begin_micro_batch(self, last: bool) -> None:
        """Communicate during the next backward (the last micro-batch) or not (accumulation)."""
        self.sync = last

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

    def state_bytes(self) -> dict[str, int]:
        return {"params": self.param_bytes(), "grads": sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)}


def apply_data_parallel(
    model: nn.Module,
    group: dist.ProcessGroup,
    policy: DataParallelPolicy,
    *,
    select: Callable[[str], bool] | None = None,
    meter: CommMeter | None = None,
) -> DataParallel:
    """Attach bucketed, overlapped gradient all-reduce over `group` to `model`'s parameters (those `select` accepts)."""
    named = [(n, p) for n, p in model.named_parameters() if select is None or select(n)]
    return DataParallel(named, group, bucket_bytes=int(policy.bucket_mb * 2**20), aliases=tied_names(model), meter=meter)
