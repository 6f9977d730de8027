"""Global-norm gradient clipping for every layout: the norm of the single-process model's gradient, from the
pieces of it each rank holds (replicated, ZeRO shards, tensor-parallel shards, pipeline stages)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from behemoth.comm import CommMeter, all_reduce


def clip_coefficient(norm: torch.Tensor | float, max_norm: float) -> torch.Tensor:
    """What every gradient is multiplied by: max_norm / norm, at most 1."""
    return torch.clamp(max_norm / (torch.as_tensor(norm, dtype=torch.float32) + 1e-6), max=1.0)


def weighted_square(terms: list[tuple[torch.Tensor, float]], device: torch.device | None = None) -> torch.Tensor:
    """Sum of weight x |g|^2 over `terms` (float32): one rank's part of the squared global norm."""
    total = torch.zeros((), dtype=torch.float32, device=device or (terms[0][0].device if terms else None))
    for g, weight in terms:
        if weight:
            total += torch.linalg.vector_norm(g, dtype=torch.float32).square() * weight
    return total


@torch.no_grad()
def clip_grad_norm(
    terms: list[tuple[torch.Tensor, float]],
    max_norm: float,
    *,
    group: dist.ProcessGroup | None = None,
    meter: CommMeter | None = None,
    device: torch.device | None = None,
    squares: tuple[torch.Tensor, ...] = (),
) -> float:
    """Global gradient norm; every gradient in `terms` is scaled by max_norm / norm when that is below 1 (max_norm > 0).

    `terms`: (a gradient or this rank's piece of one, its weight). The squared norm is the sum over `group`'s ranks
    of weight x |piece|^2, so a piece that n ranks hold identical copies of carries weight 1/n, and a piece another
    rank counts (a pipeline's second copy of a tied weight) weight 0: it is only scaled. No group: the local sum is global.
    `squares`: weighted squared norms of gradients not in `terms` (offload's, summed as each unit's completed).
    """
    grads = [g for g, _ in terms]
    total = torch.zeros((), dtype=torch.float32, device=device or (grads[0].device if grads else None))
    for square in squares:
        total += square
    total += weighted_square(terms, total.device)
    if group is not None:
        all_reduce(total, group, meter)
    norm = total.sqrt()
    if max_norm > 0 and grads:
        torch._foreach_mul_(grads, clip_coefficient(norm, max_norm).to(grads[0].dtype))
    return float(norm)
