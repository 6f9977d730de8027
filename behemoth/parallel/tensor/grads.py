"""Gradients of a tensor-parallel model, wherever the data-parallel layer keeps them.

Two things TP adds after the data-parallel (or ZeRO) reduction, before clipping:

- the gradient of a replicated parameter that sequence parallelism runs on a sequence chunk (norm
  weights, row-parallel biases) is a partial sum on each tp rank: it is summed over tp, all such
  gradients in one all-reduce, once per step (sums over dp and over tp commute, and accumulation
  over micro-batches is a sum too);
- the global gradient norm counts each split parameter's shards on every tp rank and each
  replicated parameter once (its square weighted 1/t on each of the t ranks; `parallel/clip.py`).

Gradients live in `param.grad` under plain data parallelism, or as this rank's slices of flat
ZeRO shards (`sync.groups[i].grad_shard`, cut by `layout.pieces`); `grad_slices` reads either, by
single-process name. ZeRO's flat layouts are identical on every tp rank (split parameters have equal
local shapes on all of them), so a tp collective over slices lines up element by element.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from behemoth.comm import reduce_flat
from behemoth.models.init import FULL_NAME
from behemoth.parallel.tensor.comm import TPComm


def grad_slices(model: nn.Module, sync: Any) -> list[tuple[str, torch.Tensor]]:
    """(single-process name, gradient or this rank's ZeRO shard of it) for every parameter, in a fixed order."""
    groups = getattr(sync, "groups", None)
    if groups and hasattr(groups[0], "grad_shard"):
        return [(g.layout.names[pc.index], g.grad_shard[pc.shard_offset:pc.shard_offset + pc.numel])
                for g in groups for pc in g.layout.pieces(g.rank)]
    return [(getattr(p, FULL_NAME, n), p.grad) for n, p in model.named_parameters() if p.grad is not None]


def sharded_over(sync: Any) -> dist.ProcessGroup | None:
    """The group whose ranks hold different gradient shards (ZeRO's dp group), or None when gradients are replicated."""
    groups = getattr(sync, "groups", None)
    return sync.group if groups and hasattr(groups[0], "grad_shard") else None


@torch.no_grad()
def sum_partial_grads(slices: list[tuple[str, torch.Tensor]], partial: set[str], tp: TPComm) -> int:
    """All-reduce over tp, as one flat buffer, the gradients named in `partial`; returns the element count."""
    return reduce_flat([g for name, g in slices if name in partial], tp.all_reduce)
