"""Global-norm gradient clipping for every layout: the norm of the single-process model's gradient, from the
pieces of it each rank holds (replicated, ZeRO shards, tensor-parallel shards, pipeline stages)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from behemoth.comm import CommMeter, all_reduce


@torch.no_grad()
def clip_grad_norm(slices: list[tuple[str, torch.Tensor]], max_norm: float, *,
                   groups: Iterable[dist.ProcessGroup | None] = (), meter: CommMeter | None = None,
                   split: set[str] | frozenset[str] = frozenset(), tp_size: int = 1,
                   counted: Callable[[str], bool] | None = None, device: torch.device | None = None) -> float:
    """Global gradient norm; every gradient in `slices` is scaled by max_norm / norm when that is below 1 (max_norm > 0).

    `slices`: (single-process name, the gradient or this rank's shard of it). A name in `split` is a tensor-parallel
    shard, counted in full on every tp rank; any other is replicated over tp, its square weighted 1/tp_size so the
    tp sum counts it once. `counted(name)` False: another rank counts that parameter (a pipeline's second copy of a
    tied weight). The sum of squares is all-reduced over each of `groups` (None entries are skipped).
    """
    grads = [g for _, g in slices]
    total = torch.zeros((), dtype=torch.float32, device=device or (grads[0].device if grads else None))
    for name, g in slices:
        if counted is None or counted(name):
            total += torch.linalg.vector_norm(g, dtype=torch.float32).square() / (1 if name in split else tp_size)
    for group in groups:
        if group is not None:
            all_reduce(total, group, meter)
    norm = total.sqrt()
    if max_norm > 0 and grads:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(grads[0].dtype))
    return float(norm)
