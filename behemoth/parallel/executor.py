"""The executor protocol: how one step's micro-batches go through a parallel model, whatever its layout.

    loss = executor.run(micro_batches, loss_fn, autocast)          # forward and backward of every micro-batch
    stats = executor.forward_only(batches, loss_sum, autocast)      # [summed token loss, tokens], no gradients
    logits = executor.logits(inputs)                                # each input's logits (this rank's vocabulary shard)

Three implementations: `MicroBatchLoop` (the whole model on this rank: one micro-batch after another, the syncs told
which is the last), the pipeline (parallel/pipeline/, wrapped in `PipelineSteps` so that the syncs reduce once, after
every stage's passes) and offload's streamer (offload/runtime.py: each unit streamed from its tier for every
micro-batch at once). The engine calls `run` and `forward_only` and nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import torch

from behemoth.models.causal_lm import CausalLM, counted_targets
from behemoth.parallel.sync import GradSync

Batch = list[tuple[torch.Tensor, torch.Tensor]]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Autocast = Callable[[], contextlib.AbstractContextManager]


class Executor(Protocol):
    """Runs a step's micro-batches through this rank's part of a model."""

    def run(self, micro_batches: Batch, loss_fn: LossFn, autocast: Autocast) -> torch.Tensor:
        """Forward and backward of every micro-batch; this rank's share of the summed (scaled) loss."""

    def forward_only(self, batches: Batch, loss_sum: LossFn, autocast: Autocast) -> torch.Tensor:
        """[summed token loss, token count] (float64) over the batches this rank computes the loss of."""

    def logits(self, inputs: list[torch.Tensor], autocast: Autocast = contextlib.nullcontext) -> list[torch.Tensor]:
        """Each input's logits, where the whole forward runs on this rank."""


class MicroBatchLoop:
    """The whole model on this rank: micro-batches one after another; the syncs reduce during the last one's backward."""

    def __init__(self, lm: CausalLM, syncs: list[GradSync], device: torch.device) -> None:
        self.lm, self.syncs, self.device = lm, syncs, device

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch's logits and the targets they are scored against (a subclass may shard both)."""
        return self.lm.logits(inputs.to(self.device)), targets.to(self.device)

    def run(self, micro_batches: Batch, loss_fn: LossFn, autocast: Autocast) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            for sync in self.syncs:
                sync.begin_micro_batch(last=i == len(micro_batches) - 1)
            with autocast():
                logits, scored = self.forward(inputs, targets)
            loss = loss_fn(logits, scored)
            loss.backward()
            total += loss.detach()
        return total

    def forward_only(self, batches: Batch, loss_sum: LossFn, autocast: Autocast) -> torch.Tensor:
        stats = torch.zeros(2, dtype=torch.float64, device=self.device)
        for inputs, targets in batches:
            with autocast():
                logits, scored = self.forward(inputs, targets)
            stats[0] += loss_sum(logits, scored).double()
            stats[1] += counted_targets(scored)
        return stats

    def logits(self, inputs: list[torch.Tensor], autocast: Autocast = contextlib.nullcontext) -> list[torch.Tensor]:
        with autocast():
            return [self.lm.logits(x.to(self.device)) for x in inputs]


class PipelineSteps:
    """A pipeline's executor (run, forward_only) with the syncs told to reduce once, after all its passes: the schedule
    interleaves micro-batches, so none of them is the last to reach a parameter."""

    def __init__(self, pipeline: PipelinedRun, syncs: list[GradSync]) -> None:
        self.pipeline, self.syncs = pipeline, syncs

    def run(self, micro_batches: Batch, loss_fn: LossFn, autocast: Autocast) -> torch.Tensor:
        for sync in self.syncs:  # the data-parallel sums run once, in finish
            sync.begin_micro_batch(last=False)
        return self.pipeline.run(micro_batches, loss_fn, autocast)

    def forward_only(self, batches: Batch, loss_sum: LossFn, autocast: Autocast) -> torch.Tensor:
        return self.pipeline.forward_only(batches, loss_sum, autocast)

    def logits(self, inputs: list[torch.Tensor], autocast: Autocast = contextlib.nullcontext) -> list[torch.Tensor]:
        raise RuntimeError("a pipelined model has no whole forward on one rank; run its stages through the pipeline")


class PipelinedRun(Protocol):
    def run(self, micro_batches: Batch, loss: LossFn, autocast: Autocast) -> torch.Tensor: ...

    def forward_only(self, batches: Batch, loss_sum: LossFn, autocast: Autocast) -> torch.Tensor: ...
