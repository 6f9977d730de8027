"""The gradient-sync protocol: what data parallelism and each ZeRO stage do with the gradients backward produces.

The engine holds a list of syncs, each over its own group and its own parameters (dense parameters over
dp x ep and expert parameters over dp, for a mixture of experts), and drives every layout's step through
the same calls:

    zero_grad()                      before the first micro-batch (an executor, parallel/executor.py, runs them)
    begin_micro_batch(last)          reduce during the coming backward (the last micro-batch) or accumulate
    stage_done(stage)                under a pipeline: a backward or weight-gradient pass of pipeline stage
                                     `stage` has written its gradients for one micro-batch
    finish()                         after the last backward: every gradient reduced (or its shard complete)
    grad_slices()                    (single-process name, this rank's gradient or its shard of it)
    build_optimizer(settings)        AdamW over what this rank steps (whole parameters, or its shards)

The loss is divided by the global batch's token count once, in the engine, so every reduction sums.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from behemoth.config import TrainConfig


@dataclass(frozen=True)
class AdamWSettings:
    """The optimizer's hyper-parameters (the learning rate is set again at every step by the schedule)."""

    lr: float
    betas: tuple[float, float]
    weight_decay: float
    kernel: str = "foreach"  # torch's AdamW implementation: for-loop, foreach or fused (adamw_kernel picks one per device)

    def kernel_flags(self) -> dict[str, bool]:
        """torch's `foreach` / `fused` arguments for the kernel (both False: the for-loop)."""
        return {"foreach": self.kernel == "foreach", "fused": self.kernel == "fused"}


def decays(shape: tuple[int, ...] | torch.Size) -> bool:
    """The single-process weight-decay rule: matrices and embeddings decay, biases and norms do not."""
    return len(shape) >= 2


def with_tied_names(state: dict[str, Any], aliases: dict[str, list[str]]) -> dict[str, Any]:
    """`state` with each tied weight also under its other names (as in module.state_dict()); returns `state`."""
    for name, others in aliases.items():
        if name in state:
            state.update(dict.fromkeys(others, state[name]))
    return state


def adamw_kernel(train: TrainConfig, device: torch.device) -> str:
    """torch's AdamW implementation for the device: train.adamw, or by default fused on CUDA and the CPU (one pass over
    each tensor, 4-15x torch's default loop on the CPU and within a few ulps of the for-loop; the same element for
    element however a tensor is sharded) and foreach elsewhere (docs/performance.md, benchmarks/bench_optimizer.py)."""
    if train.adamw != "auto":
        return train.adamw
    return "fused" if device.type in ("cuda", "cpu") else "foreach"


def adamw_settings(train: TrainConfig, device: torch.device | None = None) -> AdamWSettings:
    """AdamW as configured; weight decay applies to matrices and embeddings only (not biases or norms)."""
    kernel = adamw_kernel(train, device or torch.device("cpu"))
    return AdamWSettings(train.lr, (train.beta1, train.beta2), train.weight_decay, kernel)


def adamw_with_state(decay: list[nn.Parameter], no_decay: list[nn.Parameter], settings: AdamWSettings) -> torch.optim.AdamW | None:
    """AdamW with weight decay on `decay` only, its state created now (zero moments, step 0) so that a checkpoint can
    be loaded into it before the first step. None when there is nothing to step."""
    groups = [g for g in ({"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    if not groups:
        return None
    optimizer = torch.optim.AdamW(groups, lr=settings.lr, betas=settings.betas, **settings.kernel_flags())
    for p in decay + no_decay:  # the fused kernel keeps its step count on the parameter's device, as torch's AdamW creates it
        step = torch.zeros((), device=p.device) if settings.kernel == "fused" else torch.tensor(0.0)
        optimizer.state[p] = {"step": step, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    return optimizer


class Optimizer(abc.ABC):
    """What the engine needs of an optimizer: learning rate, step, checkpoint state and its size."""

    param_groups: list[dict[str, Any]]

    @abc.abstractmethod
    def step(self) -> None: ...

    @abc.abstractmethod
    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Optimizer state keyed by single-process parameter names (for DCP)."""

    @abc.abstractmethod
    def state_bytes(self) -> int: ...

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr


class GradSync(abc.ABC):
    """Keeps the gradients of some parameters in step over a group of data-parallel replicas."""

    group: dist.ProcessGroup
    sharded: bool  # True: after finish() each rank holds only its shard of the summed gradients
    # True: the optimizer steps during backward (offload's fused step), before the global norm is known, so a step
    # cannot be skipped; such a sync steps no part whose gradient is not finite, so the weights stay finite
    steps_in_backward: bool = False
    # True: parameters live as shards and are gathered for the passes (ZeRO-3, streamed offload), so a weight must not
    # be used outside its unit's window (the fused head + loss would gather the head's unit once more and hold it)
    gathers_parameters: bool = False

    @property
    def replicas(self) -> int:
        """Ranks of `group` that hold each gradient slice this rank holds (1 when sharded)."""
        return 1 if self.sharded else dist.get_world_size(self.group)

    @abc.abstractmethod
    def zero_grad(self) -> None: ...

    def begin_micro_batch(self, last: bool) -> None:
        """Reduce during the coming backward (the last micro-batch) or accumulate (syncs that reduce later need nothing)."""

    def stage_done(self, stage: int) -> None:
        """Under a pipeline, pipeline stage `stage` wrote its gradients for one micro-batch (most syncs wait for finish)."""

    @abc.abstractmethod
    def finish(self) -> None: ...

    @abc.abstractmethod
    def grad_slices(self) -> list[tuple[str, torch.Tensor]]: ...

    @abc.abstractmethod
    def build_optimizer(self, settings: AdamWSettings) -> Optimizer: ...

    @abc.abstractmethod
    def model_state(self) -> dict[str, Any]:
        """The parameters (or this rank's shards of them) by every single-process name they have, for DCP."""

    @abc.abstractmethod
    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for these parameters and gradients (plus peaks of short-lived buffers, once measured)."""

    def measure_buffers(self) -> None:
        """Count the peaks of short-lived buffers from now on (off the training path until asked: counting waits)."""

    def after_load(self, optimizer: Optimizer) -> None:
        """A checkpoint was loaded into `model_state()` and the optimizer's state: make the compute parameters agree."""

    def held_grad_square(self) -> torch.Tensor | None:
        """The weighted squared norm of gradients this sync keeps out of `grad_slices` (offload's, on their tier), or None."""
        return None

    def clip_held_grads(self, coef: float, max_norm: float) -> None:
        """The clipping coefficient for those gradients (`grad_slices` are clipped in place by the caller)."""

    def step_metrics(self) -> dict[str, float]:
        """Measurements of the step just taken (offload's bytes per tier); empty for most syncs."""
        return {}

    def close(self) -> None:
        """Release what outlives a step (offload's I/O threads and scratch directory)."""
