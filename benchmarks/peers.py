"""What the peers' training loops share, written as a PyTorch user writes it."""

from __future__ import annotations

from typing import Any

import torch


def plain_adamw(model: torch.nn.Module, train: Any) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices and embeddings only (behemoth's rule), state created at the first step."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), foreach=True)
