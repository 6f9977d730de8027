"""The training step, for every layout: the one owner of what happens between two optimizer steps.

    model = parallelize(build_causal_lm(...), plan, runtime, ...)   # parallelize.py: no optimizer
    engine = Engine(model, cfg.train, tokens_per_step)              # the optimizers, on top of the model's syncs
    engine.train_step(micro_batches, lr)

A step: forward and backward of every micro-batch (by the model's executor: the plain micro-batch loop, the
pipeline, or offload's streamer; parallel/executor.py), then, once, here: finish the gradients (pipeline copies, data-parallel
or ZeRO reductions, sequence-parallel partial sums), clip by the global norm, step the optimizers, and
reduce the loss. `micro_loss` is the one place the loss is scaled (a mixture of experts' auxiliary losses get
the same scale, from the engine, for the backward their layers start; see models/moe.py). Between steps an MoE
model's expert layout may change (`model.adapter`, Tutel's run-time choice), which changes speed, not results.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from behemoth.config import Config, TrainConfig
from behemoth.metrics import synchronize
from behemoth.models.causal_lm import build_causal_lm
from behemoth.models.gemm import agree as agree_gemm
from behemoth.models.gemm import route_linears, set_gemm
from behemoth.offload import OffloadPolicy
from behemoth.parallel.sync import adamw_kernel, adamw_settings  # noqa: F401 - here since the engine picked them
from behemoth.parallelize import ParallelModel, parallelize
from behemoth.topology import Runtime, keep_freed_host_memory

Batch = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class StepResult:
    loss: float  # mean token loss over the global batch
    grad_norm: float  # global norm before clipping
    metrics: dict[str, Any] = field(default_factory=dict)  # layout-specific: an MoE's losses and expert usage, offload's bytes per tier
    skipped: bool = False  # the gradient was not finite, so the optimizers did not step


def lr_at(step: int, train: TrainConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr_ratio * lr` at the last step."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    floor = train.lr * train.min_lr_ratio
    return floor + 0.5 * (train.lr - floor) * (1 + math.cos(math.pi * progress))


class Engine:
    """Trains a parallel model: its optimizers, and the step every layout shares."""

    def __init__(self, model: ParallelModel, train: TrainConfig, tokens_per_step: int) -> None:
        self.model, self.train, self.tokens_per_step = model, train, tokens_per_step
        self.step_targets = tokens_per_step  # the loss's denominator this step: the global batch's counted targets
        set_gemm(train.gemm)  # which library multiplies the CPU float32 linears (models/gemm.py), for every layer routed:
        if model.rt.device.type == "cpu":
            agree_gemm(model.rt.world_group)  # auto: rank 0's measurement for every rank, so replicas round alike
        route_linears(model.module)  # last, so LoRA, int8 bases and TP/ZeRO wrappers have already seen plain nn.Linear
        self.optimizers = [sync.build_optimizer(adamw_settings(train, model.rt.device)) for sync in model.syncs]
        # the loss paths below take the head's input, logits in chunks (or fused whole where the weights stay resident)
        head = model.lm.chunked_head(train.loss_chunk, fuse=not any(s.gathers_parameters for s in model.syncs))
        self.loss_head = head.deferred if head is not None else contextlib.nullcontext
        if model.lm.routers is not None:  # the auxiliary losses' gradient, scaled as micro_loss scales the token loss
            model.lm.routers.loss_scale = 1.0 / tokens_per_step
            model.lm.routers.reduce = model.reduce_over_batch  # the pooled load-balancing loss counts every data rank's tokens

    @property
    def device(self) -> torch.device:
        return self.model.rt.device

    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.train.precision == "bf16")

    def micro_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The one place the loss is scaled: a micro-batch's summed token loss over the global batch's count of counted
        targets (all of them, or a chat's unmasked ones), so the gradients summed over ranks and micro-batches are the
        global mean's gradient."""
        return self.model.loss_sum(logits, targets) / self.step_targets

    def forward_backward(self, micro_batches: Batch) -> torch.Tensor:
        """Every micro-batch's forward and backward, by the model's executor; this rank's share of the scaled loss."""
        with self.loss_head():
            return self.model.executor.run(micro_batches, self.micro_loss, self.autocast)

    def train_step(self, micro_batches: Batch, lr: float, counted_targets: int | None = None) -> StepResult:
        """Forward/backward every micro-batch, finish the gradients, clip, step the optimizers, reduce the loss.

        `counted_targets`: the global batch's targets the loss counts (default: every token); every rank passes the same."""
        model = self.model
        self.step_targets = max(1, counted_targets if counted_targets is not None else self.tokens_per_step)
        model.module.train()
        started = self.begin_step()
        for sync in model.syncs:
            sync.zero_grad()
        for optimizer in self.optimizers:  # before backward: an offloaded unit may step as soon as its gradient is complete
            optimizer.set_lr(lr)
        loss = model.start_reduce_over_batch(self.forward_backward(micro_batches).clone())  # summed while the step goes on
        model.finish_grads()
        grad_norm = model.clip_grads(self.train.grad_clip, self.device)
        if not math.isfinite(grad_norm):  # not applied (every rank sees the same norm, so all skip alike); a step fused into
            # backward applied its finite part already, which only train.nonfinite=stop accepts (problems() refuses skip)
            return StepResult(loss=float(loss()), grad_norm=grad_norm, skipped=True)
        for optimizer in self.optimizers:
            optimizer.step()
        metrics = model.step_metrics()
        if model.adapter is not None:
            synchronize(self.device)
            model.adapter.after_step(time.perf_counter() - started, metrics, self.device)
        return StepResult(loss=float(loss()), grad_norm=grad_norm, metrics=metrics)

    def begin_step(self) -> float:
        """Before a step: clear the routers' statistics, let the expert-layout adapter pick this step's layout; the time."""
        if self.model.lm.routers is not None:
            self.model.lm.routers.reset()
        if self.model.adapter is not None:
            self.model.adapter.before_step()
            synchronize(self.device)
        return time.perf_counter()

    @torch.no_grad()
    def evaluate(self, batches: Batch) -> float:
        """Mean token loss over the batches (each rank its share), summed over every rank that saw a part of them."""
        model = self.model
        model.module.eval()
        with self.loss_head():
            stats = model.executor.forward_only(batches, model.loss_sum, self.autocast)
        model.reduce_over_batch(stats)
        return float(stats[0] / stats[1])

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state (distinct storages), plus buffer peaks."""
        return {**self.model.state_bytes(), "optimizer": sum(o.state_bytes() for o in self.optimizers)}

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Model and optimizer tensors keyed by single-process parameter names, for DCP."""
        optim = {name: state for o in self.optimizers for name, state in o.state_dict().items()}
        return self.model.checkpoint_views({"model": self.model.model_state(), "optim": optim})

    def after_load(self) -> None:
        """A checkpoint was loaded into `state_dict()`'s tensors: make the compute parameters agree (ZeRO's masters)."""
        for sync, optimizer in zip(self.model.syncs, self.optimizers):
            sync.after_load(optimizer)

    def close(self) -> None:
        """Release the model's background resources (offload's I/O threads and scratch); the engine is done."""
        self.model.close()


def build_model(cfg: Config, rt: Runtime, *, resume: bool = False) -> ParallelModel:
    """The configured model, laid out over `rt` by the config's plan (no optimizer); `resume`: a resumed run (a journaled
    offload scratch it left is reopened instead of drawn again)."""
    offload = (
        OffloadPolicy.of(cfg.offload, run_dir=cfg.run.dir, grad_clip=cfg.train.grad_clip, param_dtype=cfg.parallel.param_dtype, resume=resume)
        if cfg.offload.enabled
        else None
    )
    return parallelize(
        build_causal_lm(cfg.model, cfg.hf),
        cfg.parallel,
        rt,
        batch=cfg.batch_layout(rt.dims),
        seq_len=cfg.seq_len,
        seed=cfg.train.seed,
        timeout_s=cfg.run.timeout_s,
        offload=offload,
        lora=cfg.finetune.lora,
        compile=cfg.train.compile,
    )


def keeps_host_memory(cfg: Config) -> bool:
    """train.host_memory: keep, or auto without offload (an offloading run budgets its host memory, and kept memory
    stays resident and fragments: 148 MiB of growth where the states need 72 in tests/test_offload_budget.py)."""
    return cfg.train.host_memory == "keep" or (cfg.train.host_memory == "auto" and not cfg.offload.enabled and cfg.offload.max_memory_gb is None)


def build_engine(cfg: Config, rt: Runtime, *, resume: bool = False) -> Engine:
    """The configured model under its plan, with its optimizers: ready to train."""
    if keeps_host_memory(cfg):
        keep_freed_host_memory()  # no page faults on every step's large tensors (topology.py)
    return Engine(build_model(cfg, rt, resume=resume), cfg.train, cfg.train.global_batch * cfg.seq_len)
