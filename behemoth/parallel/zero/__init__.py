"""ZeRO (Rajbhandari et al. 2020): shard optimizer state (stage 1), gradients (2) and parameters (3).

    units = shard_parameters(model, dp_group, layers=view)   # stage 3 only, on the meta model, before materialize
    materialize(model, ...)
    sync = apply_zero(model, dp_group, ZeroPolicy(stage=3), units=units)   # a GradSync (parallel/sync.py)
    optimizer = sync.build_optimizer(settings)                             # the sharded AdamW, when training

layout.py (flat layouts, pure), groups.py (stages 1-2's buckets), units.py (stage 3's units: embedding, blocks,
head), sharded.py (stage 3's gather/free/prefetch), optim.py (the sharded AdamW), runtime.py (the syncs, one
class per stage), ../chunked.py (DCP chunks keyed by single-process names).
"""

from behemoth.parallel.zero.runtime import (
    MAX_BUCKETS_IN_FLIGHT,
    ZeroPolicy,
    ZeroStage1,
    ZeroStage2,
    ZeroStage3,
    ZeroSync,
    apply_zero,
    comm_volume,
    held_bytes,
    shards_nothing,
)
from behemoth.parallel.zero.units import ExpertUnits, LayerNames, UnitSpec, shard_parameters

__all__ = [
    "ExpertUnits",
    "LayerNames",
    "MAX_BUCKETS_IN_FLIGHT",
    "UnitSpec",
    "ZeroPolicy",
    "ZeroStage1",
    "ZeroStage2",
    "ZeroStage3",
    "ZeroSync",
    "apply_zero",
    "comm_volume",
    "held_bytes",
    "shard_parameters",
    "shards_nothing",
]
