"""A burst plan under behemoth's engine: the executor that runs a step through `BurstModel`, and one gradient sync per
distinct parameter width, so that each rank holds, sums, clips and steps only the parameters its layers use.

The data loader gives each rank its data-parallel share of the global batch (rows in rank order); the executor
gathers them back into the global batch, which every layer then re-splits over its own width. A parameter belongs to
the group of the widest layer that uses it (ranks 0 .. c-1, as the plan prices it): its gradient is summed there, its
AdamW state lives there, and the ranks outside it release its storage (DeepPool keeps a layer's parameters only on
its group). Rank 0 is in every group, so it holds the whole model; a checkpoint is the union of the ranks' parameters
under single-process names (DCP writes each once), loadable under any layout.
"""

from __future__ import annotations

import contextlib

import torch

from behemoth.comm import all_gather
from behemoth.models.causal_lm import tied_names
from behemoth.models.init import FULL_NAME
from behemoth.parallel.burst.runtime import BurstModel
from behemoth.parallel.data import ReplicatedSync
from behemoth.parallel.executor import Autocast, Batch, LossFn, MicroBatchLoop
from behemoth.parallel.sync import GradSync


class BurstSync(ReplicatedSync):
    """The parameters whose widest layer is `width` wide: held, summed over and stepped by ranks 0 .. width-1 only.
    On the other ranks it holds nothing (no parameter, gradient or optimizer state) and does nothing."""

    sharded = False

    def __init__(self, burst: BurstModel, width: int) -> None:
        self.burst, self.width = burst, width
        self.member = burst.groups.rank < width
        self.group = burst.groups.group(width) or burst.groups.job  # (unused outside the group; a group of one sums nothing)
        model = burst.lm.module
        ours = {id(p) for p in burst.params_of_width(width)}
        named = [(getattr(p, FULL_NAME, n), p) for n, p in model.named_parameters() if id(p) in ours]
        self.named = named if self.member else []
        self.aliases = tied_names(model)

    @property
    def replicas(self) -> int:
        """Ranks holding an identical copy of each gradient: the group's (the global norm weighs each copy 1/width)."""
        return self.width

    def zero_grad(self) -> None:
        for _, p in self.named:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()

    def finish(self) -> None:
        """Sum the gradients over the group, or finish the sums an overlapped backward started (members only: the
        others hold none)."""
        if self.member:
            self.burst.sync_gradients([self.width])

    def state_bytes(self) -> dict[str, int]:
        return {"params": self.param_bytes(), "grads": sum(p.grad.numel() * p.grad.element_size() for _, p in self.named if p.grad is not None)}


def burst_syncs(burst: BurstModel) -> list[BurstSync]:
    """One sync per distinct parameter width (narrowest first, the same list on every rank), after releasing the
    storage of the parameters this rank does not use."""
    release_unused(burst)
    return [BurstSync(burst, w) for w in sorted({w for _, w in burst.param_width.values()})]


def release_unused(burst: BurstModel) -> int:
    """Free the storage of every parameter this rank's layers never use (an empty tensor in its place); the bytes."""
    freed = 0
    for p, width in burst.param_width.values():
        if burst.groups.rank >= width and p.numel():
            freed += p.numel() * p.element_size()
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            p.grad = None
    return freed


class BurstSteps(MicroBatchLoop):
    """The executor of a burst plan: the step's rows (and evaluation's) gathered into the global batch and run layer by
    layer at each layer's width; logits only where every layer is held (rank 0). With `overlap` (the default), each
    parameter's gradient sum starts as soon as the first layer using it ends backward, as `BurstModel(overlap=True)`
    runs it, and each `BurstSync.finish` waits for its width's sums."""

    def __init__(self, burst: BurstModel, syncs: list[GradSync], device: torch.device, *, overlap: bool = True) -> None:
        super().__init__(burst.lm, syncs, device)
        self.burst, self.overlap = burst, overlap

    def run(self, micro_batches: Batch, loss_fn: LossFn, autocast: Autocast) -> torch.Tensor:
        idx = self.global_rows(torch.cat([x for x, _ in micro_batches]))
        targets = self.global_rows(torch.cat([t for _, t in micro_batches]))
        return self.burst.forward_backward(idx, targets, loss_fn, autocast, overlap=self.overlap)

    def forward_only(self, batches: Batch, loss_sum: LossFn, autocast: Autocast) -> torch.Tensor:
        stats = torch.zeros(2, dtype=torch.float64, device=self.device)
        for inputs, targets in batches:
            stats += self.burst.forward_loss(self.global_rows(inputs), self.global_rows(targets), loss_sum, autocast)
        return stats

    def logits(self, inputs: list[torch.Tensor], autocast: Autocast = contextlib.nullcontext) -> list[torch.Tensor]:
        if any(p.numel() == 0 for p in self.lm.module.parameters()):
            raise RuntimeError(f"rank {self.burst.groups.rank} of a burst plan holds only its layers: logits run on rank 0")
        return super().logits(inputs, autocast)

    def global_rows(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the batch and every other rank's, in rank order (the data loader's order)."""
        local = local.to(self.device).contiguous()
        world = self.burst.groups.world
        out = torch.empty((world * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=self.device)
        all_gather(out, local, self.burst.groups.job)
        return out
