"""Builds a model under a plan and runs one training step.

The engine only decides the order in which the parallel transforms are applied and holds what
they return; the algorithms live in `parallel/` and `memory/`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from behemoth.comm import CommMeter, all_reduce
from behemoth.config import Config, TrainConfig
from behemoth.models.causal_lm import build_causal_lm, summed_token_loss
from behemoth.models.init import materialize
from behemoth.parallel.data import DataParallel, apply_data_parallel
from behemoth.parallel.pipeline.apply import apply_pipeline
from behemoth.parallel.pipeline.views import view_of
from behemoth.parallel.recompute import apply_recompute, recompute_ranks
from behemoth.parallel.tensor import TensorParallel, TPComm, apply_tensor_parallel
from behemoth.parallel.zero import UnitSpec, Zero, apply_zero, shard_parameters
from behemoth.topology import Runtime


@dataclass
class StepResult:
    loss: float        # mean token loss over the global batch
    grad_norm: float   # global norm before clipping


def lr_at(step: int, train: TrainConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr_ratio * lr` at the last step."""
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    span = max(1, train.steps - train.warmup_steps)
    progress = min(1.0, (step - train.warmup_steps) / span)
    floor = train.lr * train.min_lr_ratio
    return floor + 0.5 * (train.lr - floor) * (1 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, train: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only (not biases or norms)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), foreach=True)


class Engine:
    """One rank's model, gradient synchronization and optimizer under the configured plan."""

    def __init__(self, cfg: Config, rt: Runtime) -> None:
        self.cfg, self.rt = cfg, rt
        self.meter = CommMeter()
        self.lm = build_causal_lm(cfg.model, cfg.hf)  # behemoth's GPT or a transformers model, on meta
        self.model = self.lm.module
        # Order of application (DESIGN.md): transforms that change which parameters a rank holds
        # (pipeline cut, tensor/expert sharding) come first, on the meta device, so nothing is
        # allocated for parameters this rank will not keep. Materialization then draws each kept
        # parameter from (seed, name). Data parallelism comes last because it only attaches to the
        # real gradients of the real parameters.
        # Pipeline cut first: it decides which blocks, embedding and head this rank holds at all.
        self.pipeline = apply_pipeline(self.model, cfg, rt) if rt.dims.pp > 1 else None
        # Tensor/sequence parallel next, still on meta: split layers keep only this rank's part of each
        # weight, marked so that materialize draws the full (seed, name) tensor and keeps that part.
        self.tp = self.apply_tensor_parallel()
        # the summed token loss; vocabulary-parallel when the head is split (each rank holds 1/t of the logits)
        self.loss_fn = self.tp.cross_entropy_sum if self.tp is not None else summed_token_loss
        # Recomputation wraps block forwards in place (names unchanged); under a pipeline, per stage.
        view = view_of(cfg.hf.arch)  # where GPT, Llama or GPT-2 keep their embedding, blocks and head
        blocks = self.model.get_submodule(view.blocks)
        apply_recompute(blocks, self.pipeline.recomputes if self.pipeline else 0 in recompute_ranks(cfg.parallel.recompute, [1]))
        # ZeRO-3 cuts every parameter to this rank's shard, still on meta, so materialize draws only that;
        # its units (gathered together) are the embedding, each block and the head of the same layered view.
        zero_units = (shard_parameters(self.model, rt.group("dp"), layers=view, tie_embeddings=cfg.model.tie_embeddings)
                      if cfg.parallel.zero_stage == 3 else None)
        materialize(self.model, seed=cfg.train.seed, device=rt.device, init_spec=self.lm.init_spec)
        self.lm.after_materialize(rt.device)  # buffers, weights from hf.weights
        self.sync, self.optimizer = self.apply_data_parallel(zero_units)
        self.tokens_per_step = cfg.train.global_batch * cfg.seq_len
        if self.pipeline is not None:
            self.pipeline.attach(self)

    def apply_data_parallel(self, zero_units: list[UnitSpec] | None) -> tuple[DataParallel | Zero, Any]:
        """Replicated data parallelism (zero_stage 0) or ZeRO 1-3: the gradient sync and the optimizer that steps what this rank owns."""
        plan, train, group = self.cfg.parallel, self.cfg.train, self.rt.group("dp")
        if plan.zero_stage == 0:
            return apply_data_parallel(self.model, group, bucket_mb=plan.bucket_mb, meter=self.meter), build_optimizer(self.model, train)
        zero = apply_zero(self.model, group, stage=plan.zero_stage, bucket_mb=plan.bucket_mb, prefetch=plan.prefetch,
                          param_dtype=plan.param_dtype, lr=train.lr, betas=(train.beta1, train.beta2),
                          weight_decay=train.weight_decay, units=zero_units, meter=self.meter,
                          chunks=self.pipeline.stage_parameters() if self.pipeline is not None else None)
        return zero, zero.optimizer

    def apply_tensor_parallel(self) -> TensorParallel | None:
        """Split the meta model over the tp group by its plan (tp = 1: nothing to do)."""
        if self.rt.dims.tp == 1:
            return None
        tp = apply_tensor_parallel(self.model, TPComm.of(self.rt.group("tp"), self.meter), self.lm.tp_plan,
                                   sequence_parallel=self.cfg.parallel.sequence_parallel)
        self.lm.after_tensor_parallel(self.rt.dims.tp)
        return tp

    def autocast(self) -> contextlib.AbstractContextManager:
        enabled = self.cfg.train.precision == "bf16"
        return torch.autocast(self.rt.device.type, dtype=torch.bfloat16, enabled=enabled)

    def loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy of one micro-batch, in float32."""
        with self.autocast():
            logits = self.lm.logits(inputs.to(self.rt.device))
        return self.loss_fn(logits, targets.to(self.rt.device))

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> StepResult:
        """Forward/backward every micro-batch, reduce gradients, clip, and step the optimizer."""
        if self.pipeline is not None:  # the schedule's executor runs the micro-batches and the optimizer step
            return StepResult(*self.pipeline.train_step(micro_batches, lr))
        self.model.train()
        self.sync.zero_grad()
        total = torch.zeros((), device=self.rt.device)
        for i, (inputs, targets) in enumerate(micro_batches):
            self.sync.set_sync(i == len(micro_batches) - 1)
            # The one place the loss is scaled: divide by the global batch's token count, so the
            # summed gradients over ranks and micro-batches are the global mean's gradient.
            loss = self.loss_sum(inputs, targets) / self.tokens_per_step
            loss.backward()
            total += loss.detach()
        self.sync.finish()
        if self.tp is not None:  # gradients that sequence parallelism left partial are summed over tp
            self.tp.finish_grads(self.model, self.sync)
        grad_norm = self.clip_grad_norm()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        all_reduce(total, self.rt.group("dp"))
        return StepResult(loss=float(total), grad_norm=grad_norm)

    def clip_grad_norm(self) -> float:
        """Global gradient norm, clipped; under TP split parameters count every shard, replicated ones once."""
        if self.tp is None:
            return self.sync.clip_grad_norm(self.cfg.train.grad_clip)
        return self.tp.clip_grad_norm(self.model, self.sync, self.cfg.train.grad_clip)

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean token loss over this rank's share of the validation batches, averaged over ranks."""
        if self.pipeline is not None:
            return self.pipeline.evaluate(batches)
        self.model.eval()
        stats = torch.zeros(2, dtype=torch.float64, device=self.rt.device)
        for inputs, targets in batches:
            stats[0] += self.loss_sum(inputs, targets).double()
            stats[1] += targets.numel()
        all_reduce(stats, self.rt.group("dp"))
        return float(stats[0] / stats[1])

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state (under ZeRO: distinct storages, plus buffer peaks)."""
        if isinstance(self.sync, Zero):
            return self.sync.state_bytes()
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        optim = sum(t.numel() * t.element_size() for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        return {"params": params, "grads": self.sync.grad_bytes(), "optimizer": optim}

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Model and optimizer tensors keyed by single-process parameter names, for DCP."""
        if isinstance(self.sync, Zero):  # this rank's chunks of the master weights and Adam state
            state = self.sync.state_dict()
        else:
            ensure_optimizer_state(self.optimizer)
            names = {p: n for n, p in self.model.named_parameters()}
            optim = {names[p]: dict(state) for p, state in self.optimizer.state.items()}
            state = {"model": self.model.state_dict(), "optim": optim}
        # Split tensors as full-shape views, so DCP reshards to any tp degree and export consolidates.
        return self.tp.checkpoint_views(state) if self.tp is not None else state

    def after_load(self) -> None:
        """A checkpoint was loaded into `state_dict()`: ZeRO rebuilds the compute parameters from the master shards."""
        if isinstance(self.sync, Zero):
            self.sync.after_load()


@torch.no_grad()
def ensure_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state tensors (a step with zero gradients and lr 0) so DCP can load into them."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    saved = [(p.grad, p.grad is not None and p.grad.clone()) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    for p, (grad, values) in zip(params, saved):
        p.grad = grad
        if grad is not None:
            grad.copy_(values)
