"""Builds a model under a plan and runs one training step.

The engine only decides the order in which the parallel transforms are applied and holds what
they return; the algorithms live in `parallel/` and `memory/`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from behemoth.comm import CommMeter, all_reduce
from behemoth.config import Config, TrainConfig
from behemoth.models.gpt import GPT, build_gpt
from behemoth.models.init import materialize
from behemoth.parallel.data import apply_data_parallel
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
        self.model: GPT = build_gpt(cfg.model)
        # Order of application (DESIGN.md): transforms that change which parameters a rank holds
        # (pipeline cut, tensor/expert sharding) come first, on the meta device, so nothing is
        # allocated for parameters this rank will not keep. Materialization then draws each kept
        # parameter from (seed, name). Data parallelism comes last because it only attaches to the
        # real gradients of the real parameters.
        materialize(self.model, seed=cfg.train.seed, device=rt.device, init_spec=self.model.init_spec)
        self.sync = apply_data_parallel(self.model, rt.group("dp"), bucket_mb=cfg.parallel.bucket_mb, meter=self.meter)
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.tokens_per_step = cfg.train.global_batch * cfg.seq_len

    def autocast(self) -> contextlib.AbstractContextManager:
        enabled = self.cfg.train.precision == "bf16"
        return torch.autocast(self.rt.device.type, dtype=torch.bfloat16, enabled=enabled)

    def loss_sum(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy of one micro-batch, in float32."""
        with self.autocast():
            logits = self.model(inputs.to(self.rt.device))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.to(self.rt.device).flatten(), reduction="sum")

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> StepResult:
        """Forward/backward every micro-batch, reduce gradients, clip, and step the optimizer."""
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
        grad_norm = self.sync.clip_grad_norm(self.cfg.train.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        all_reduce(total, self.rt.group("dp"))
        return StepResult(loss=float(total), grad_norm=grad_norm)

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean token loss over this rank's share of the validation batches, averaged over ranks."""
        self.model.eval()
        stats = torch.zeros(2, dtype=torch.float64, device=self.rt.device)
        for inputs, targets in batches:
            stats[0] += self.loss_sum(inputs, targets).double()
            stats[1] += targets.numel()
        all_reduce(stats, self.rt.group("dp"))
        return float(stats[0] / stats[1])

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state."""
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        optim = sum(t.numel() * t.element_size() for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)
        return {"params": params, "grads": self.sync.grad_bytes(), "optimizer": optim}

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Model and optimizer tensors keyed by single-process parameter names, for DCP."""
        ensure_optimizer_state(self.optimizer)
        names = {p: n for n, p in self.model.named_parameters()}
        optim = {names[p]: dict(state) for p, state in self.optimizer.state.items()}
        return {"model": self.model.state_dict(), "optim": optim}


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
