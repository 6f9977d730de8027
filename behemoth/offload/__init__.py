"""Out-of-core training: parameters, gradients and optimizer state on host memory or disk, streamed unit by unit.

    sync = apply_offload(lm, units, runtime, OffloadPolicy(params="disk", optimizer="disk"), seed=seed)

tiers.py (device, host, file: one interface), io.py (background I/O threads, per-unit ordering), order.py
(naive and Harmony orders as data, their residency plans and swap volumes), store.py (a unit's states on their
tiers, stepped by ZeRO's sharded AdamW, parallel/zero/adam.py: float32 or 8-bit blockwise moments), executor.py
(runs an order: fetch, gather, compute, evict; activations at block boundaries), runtime.py (the GradSync, the
streaming executor and the optimizer the engine drives), budget.py (the memory model), scratch.py (the disk
tier's directory), calibrate.py (disk, memory and compute rates measured, for the predicted step time).
"""

from behemoth.offload.runtime import OffloadOptimizer, OffloadPolicy, OffloadSync, StreamedSteps, apply_offload

__all__ = ["OffloadOptimizer", "OffloadPolicy", "OffloadSync", "StreamedSteps", "apply_offload"]
