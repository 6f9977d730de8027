"""ZeRO (Rajbhandari et al. 2020): shard optimizer state (stage 1), gradients (2) and parameters (3).

    units = shard_parameters(model, dp_group, layers=view)   # stage 3 only, on the meta model, before materialize
    materialize(model, ...)
    zero = apply_zero(model, dp_group, plan=..., units=units, ...)   # then as the engine's sync + optimizer

layout.py (flat layouts, pure), groups.py (stages 1-2), units.py (stage 3's units: embedding, blocks, head),
sharded.py (stage 3's gather/free/prefetch), optim.py (the sharded AdamW), ../chunked.py (DCP chunks keyed by
single-process names), runtime.py (`Zero`).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from behemoth.comm import CommMeter
from behemoth.parallel.zero.runtime import Zero, comm_volume, held_bytes
from behemoth.parallel.zero.units import LayerNames, UnitSpec, shard_parameters

__all__ = ["LayerNames", "Zero", "apply_zero", "comm_volume", "held_bytes", "shard_parameters", "UnitSpec"]


def apply_zero(model: nn.Module, dp_group: dist.ProcessGroup, *, stage: int, bucket_mb: float, prefetch: int, param_dtype: str,
               lr: float, betas: tuple[float, float], weight_decay: float, units: list[UnitSpec] | None = None,
               chunks: dict[int, list[nn.Parameter]] | None = None, meter: CommMeter | None = None) -> Zero:
    """Shard `model`'s optimizer state (and gradients, and parameters) over `dp_group` at ZeRO `stage` (1-3).
    `chunks`: under a pipeline, the parameters of each stage this rank holds (stages 1-2; see `Zero`)."""
    if stage not in (1, 2, 3):
        raise ValueError(f"apply_zero takes stage 1, 2 or 3, got {stage}")
    return Zero(model, dp_group, stage=stage, bucket_mb=bucket_mb, prefetch=prefetch, param_dtype=param_dtype,
                lr=lr, betas=betas, weight_decay=weight_decay, units=units, chunks=chunks, meter=meter)
