"""A burst plan under behemoth's engine: the executor that runs a step through `BurstModel`, and the gradient sync
that leaves every rank the single-process gradient of every parameter, so clipping, AdamW and checkpoints are
data parallelism's.

The data loader gives each rank its data-parallel share of the global batch (rows in rank order); the executor
gathers them back into the global batch, which every layer then re-splits over its own width. A parameter's gradient
is first summed over the group of the widest layer that uses it (ranks 0 .. c-1, as the plan prices it), then, for a
layer narrower than the job, broadcast from rank 0 (a member of every group) to the ranks outside that group: every
rank keeps the whole model and steps it alike.
"""

from __future__ import annotations

import functools
from typing import cast

import torch
import torch.distributed as dist

from behemoth.comm import Pending, all_gather, issue, plan_buckets, reduce_flat
from behemoth.models.causal_lm import tied_names
from behemoth.models.init import FULL_NAME
from behemoth.parallel.burst.runtime import BUCKET_BYTES, BurstModel
from behemoth.parallel.data import ReplicatedSync
from behemoth.parallel.executor import Autocast, Batch, LossFn, MicroBatchLoop
from behemoth.parallel.sync import GradSync


class BurstSync(ReplicatedSync):
    """Gradients of a burst plan: summed within each parameter's group, then shared with the ranks outside it."""

    sharded = False

    def __init__(self, burst: BurstModel, *, bucket_bytes: int = BUCKET_BYTES) -> None:
        self.burst, self.bucket_bytes = burst, bucket_bytes
        self.group = burst.groups.job
        model = burst.lm.module
        self.named = [(getattr(p, FULL_NAME, n), p) for n, p in model.named_parameters() if p.requires_grad]
        self.aliases = tied_names(model)

    def zero_grad(self) -> None:
        for _, p in self.named:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()

    def finish(self) -> None:
        """Sum over each parameter's group, then broadcast from rank 0 to every rank outside the narrower groups."""
        self.burst.sync_gradients()
        world = self.burst.groups.world
        for width in sorted({w for _, w in self.burst.param_width.values() if w < world}):
            params = [p for p, w in self.burst.param_width.values() if w == width and p.requires_grad]
            for bucket in plan_buckets(params, self.bucket_bytes):
                reduce_flat([cast(torch.Tensor, p.grad) for p in bucket], functools.partial(_broadcast_from_first, group=self.group))

    def state_bytes(self) -> dict[str, int]:
        return {"params": self.param_bytes(), "grads": sum(p.grad.numel() * p.grad.element_size() for _, p in self.named if p.grad is not None)}


def _broadcast_from_first(flat: torch.Tensor, group: dist.ProcessGroup) -> Pending:
    """`flat` from the group's first rank to all of it."""
    source = dist.get_global_rank(group, 0)
    return issue("broadcast", group, flat, lambda: dist.broadcast(flat, source, group=group, async_op=True), async_op=False)


class BurstSteps(MicroBatchLoop):
    """The executor of a burst plan: the step's rows gathered into the global batch and run layer by layer at each
    layer's width (evaluation and logits: this rank's whole model, as the plain loop runs them)."""

    def __init__(self, burst: BurstModel, syncs: list[GradSync], device: torch.device) -> None:
        super().__init__(burst.lm, syncs, device)
        self.burst = burst

    def run(self, micro_batches: Batch, loss_fn: LossFn, autocast: Autocast) -> torch.Tensor:
        idx = self.global_rows(torch.cat([x for x, _ in micro_batches]))
        targets = self.global_rows(torch.cat([t for _, t in micro_batches]))
        return self.burst.forward_backward(idx, targets, loss_fn, autocast)

    def global_rows(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the batch and every other rank's, in rank order (the data loader's order)."""
        local = local.to(self.device).contiguous()
        world = self.burst.groups.world
        out = torch.empty((world * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=self.device)
        all_gather(out, local, self.burst.groups.job)
        return out
