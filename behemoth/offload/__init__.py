"""Out-of-core training: parameters, gradients and optimizer state on host memory or disk, streamed unit by unit.

    sync = apply_offload(lm, units, runtime, OffloadPolicy(params="disk", optimizer="disk"), seed=seed)

the tiers (parallel/zero/tiers.py: device, host, disk, the ones in-memory ZeRO-3 uses), io.py (background I/O threads, per-unit ordering), order.py
(naive and Harmony orders as data, their residency plans and swap volumes), store.py (a unit's states on their
tiers, stepped by ZeRO's sharded AdamW, parallel/zero/adam.py: float32 or 8-bit blockwise moments), executor.py
(runs an order: fetch, gather, compute, evict; activations at block boundaries), policy.py (what a run asks of offload), runtime.py (the GradSync and
the streaming executor the engine drives), stepper.py (when a unit steps: fused or deferred), optimizer.py (the
optimizer the engine drives), budget.py (the memory model and the prefetch depth that fits), scratch.py (the disk
tier's directory), calibrate.py (disk, memory and compute rates measured, for the predicted step time).
"""

from behemoth.offload.optimizer import OffloadOptimizer
from behemoth.offload.policy import OffloadPolicy
from behemoth.offload.runtime import OffloadSync, StreamedSteps, apply_offload

__all__ = ["OffloadOptimizer", "OffloadPolicy", "OffloadSync", "StreamedSteps", "apply_offload"]
