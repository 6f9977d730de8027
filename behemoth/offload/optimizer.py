"""The optimizer the engine drives for a streamed model: AdamW over every unit's shard, stepped where the state lives
(offload/stepper.py decides when), and its checkpoint view."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from behemoth.parallel.sync import AdamWSettings, Optimizer

EIGHT_BIT = "adam8bit"  # the optimizer entries of 8-bit state in a checkpoint: loadable by the same offload layout only


class OffloadOptimizer(Optimizer):
    """AdamW over every unit's shard, stepped by the runtime where the state lives (fused or deferred)."""

    def __init__(self, sync: Any, settings: AdamWSettings) -> None:  # the OffloadSync (runtime.py) whose units it steps
        self.sync, self.settings = sync, settings
        self.param_groups = [{"lr": settings.lr}]
        self.step_tensor = torch.tensor(0.0)

    @property
    def lr(self) -> float:
        return self.param_groups[0]["lr"]

    def step(self) -> None:
        self.sync.steps.optimizer_step(self.lr)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Adam state by single-process name: float32 moments as chunks; 8-bit state as it is stored (codes and block
        scales of this rank's shard, keyed by the data-parallel layout, `EIGHT_BIT`), so it stays 8-bit on disk."""
        sync = self.sync
        sync.flush()
        self.step_tensor.fill_(float(sync.steps.step_count))
        out: dict[str, dict[str, torch.Tensor]] = {}
        world, rank = dist.get_world_size(sync.group), dist.get_rank(sync.group)
        for store in sync.stores:
            if store.adam is None:  # a frozen unit: no optimizer state
                continue
            if store.adam.bits == 32:
                m, v = (sync.tiers.optimizer.view(store.state_keys[k]) for k in ("m", "v"))
                out.update(store.moment_chunks(m, v, self.step_tensor))
            else:
                out[EIGHT_BIT] = {"step": self.step_tensor}
                out[f"{EIGHT_BIT}.dp{world}.rank{rank}.unit{store.index}"] = {
                    k: sync.tiers.optimizer.view(key) for k, key in store.state_keys.items()
                }
        return out

    def after_load(self) -> None:
        """The step count (moments were loaded where they are stored, 8-bit ones as 8-bit)."""
        self.sync.steps.step_count = int(self.step_tensor.item())

    def state_bytes(self) -> int:
        return self.sync.tiers.optimizer.resident_bytes()
