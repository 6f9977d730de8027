"""The sharded optimizer: AdamW over this rank's pieces of every parameter, float32 master weights.

Each rank steps only the elements of its shards, so its Adam moments (and, with bf16 compute, its
float32 master weights) cover Ψ/N elements. The step is adam.py's, on the flat master shard and its
moments, piece by piece: the same AdamW offload takes where its state lives (offload/store.py), so there
is one sharded AdamW whatever the tier. The groups then publish the new values to the compute parameters
(a copy to bf16 and/or an all-gather). Weight decay follows the single-process rule (parallel/sync.py `decays`).

The moments live on a tier (tiers.py): the device by default; on the host tier at stages 1-2 they are what DeepSpeed
calls ZeRO-Offload (parameters and gradients resident, each rank's optimizer shard in host memory, fetched for its
step and written back).
"""

from __future__ import annotations

import torch

from behemoth.comm import Pending
from behemoth.parallel.chunked import ChunkedTensor, chunked
from behemoth.parallel.sync import AdamWSettings, Optimizer
from behemoth.parallel.zero.adam import AdamFP32, shard_pieces
from behemoth.parallel.zero.groups import FlatGroup
from behemoth.parallel.zero.layout import FlatLayout
from behemoth.parallel.zero.tiers import DeviceTier, Tier, in_device_memory


class ShardedAdamW(Optimizer):
    """AdamW on this rank's shard of every flat group; `param_groups` and `step()` behave like torch's optimizer."""

    def __init__(self, groups: list[FlatGroup], settings: AdamWSettings, tier: Tier | None = None) -> None:
        self.groups = groups
        self.adam = AdamFP32(settings)
        self.pieces = [shard_pieces(g.layout, g.rank) for g in groups]
        self.tier = tier or DeviceTier(groups[0].master.device if groups else torch.device("cpu"))
        self.keys = [{k: f"{k}.{i}" for k in ("m", "v")} for i in range(len(groups))]
        for g, keys in zip(groups, self.keys):  # created now (zero, step 0) so that a checkpoint can be loaded before the first step
            for key in keys.values():
                self.tier.allocate(key, g.layout.shard_size, torch.float32)
        self.step_tensor = torch.tensor(0.0)  # the step count, as torch's AdamW keeps it (a checkpoint loads into it)
        self.param_groups: list[dict] = [{"lr": settings.lr}]

    @torch.no_grad()
    def step(self) -> None:
        """Update the master shards from the gradient shards, then publish them to the compute parameters."""
        self.step_tensor += 1
        count, lr = int(self.step_tensor.item()), self.param_groups[0]["lr"]
        for g, pieces, keys in zip(self.groups, self.pieces, self.keys):
            grad = g.grad_shard if g.grad_shard.dtype == torch.float32 else g.grad_shard.float()
            state = {k: self.tier.fetch(key) for k, key in keys.items()}  # the stored moments themselves on the device tier
            self.adam.step(g.master, grad, state, pieces, lr=lr, coef=1.0, step=count)
            for k, key in keys.items():
                self.tier.store(key, state[k])
        self.publish()

    @torch.no_grad()
    def publish(self) -> None:
        """Compute parameters := master weights, on every rank (all-gathers overlap each other)."""
        pending = [g.publish() for g in self.groups]
        for work in pending:
            if isinstance(work, Pending):
                work.wait()

    def state_bytes(self) -> int:
        """Bytes of optimizer state in device memory: Adam moments (unless on the host tier of a GPU), plus float32 master
        weights when they are a separate copy."""
        moments = self.tier.resident_bytes() if in_device_memory(self.tier.name, self.tier.device.type) else 0
        masters = sum(g.master.numel() * g.master.element_size() for g in self.groups if g.master.dtype != g.compute_dtype)
        return moments + masters

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Adam state keyed by single-process names, as this rank's chunks (for DCP)."""
        optim: dict[str, dict[str, torch.Tensor]] = {}
        for g, keys in zip(self.groups, self.keys):
            optim.update(moment_chunks(g.layout, g.rank, self.tier.view(keys["m"]), self.tier.view(keys["v"]), self.step_tensor))
        return optim


def shard_chunks(layout: FlatLayout, rank: int, flat: torch.Tensor) -> dict[str, ChunkedTensor]:
    """Every parameter of a flat group as `rank`'s chunk of its full tensor, aliasing `flat` (the rank's shard of
    master weights or of a moment), by single-process name; an empty chunk where the rank holds none of it."""
    held = {pc.index: pc for pc in layout.pieces(rank)}
    out = {}
    for i, (name, shape) in enumerate(zip(layout.names, layout.shapes)):
        pc = held.get(i)
        out[name] = (
            chunked(flat[:0], 0, 0, shape) if pc is None else chunked(flat[pc.shard_offset : pc.shard_offset + pc.numel], pc.start, pc.stop, shape)
        )
    return out


def moment_chunks(layout: FlatLayout, rank: int, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """Adam state by parameter name, as torch's AdamW names it: the step count and float32 moments as chunks."""
    ms, vs = shard_chunks(layout, rank, m), shard_chunks(layout, rank, v)
    return {name: {"step": step, "exp_avg": ms[name], "exp_avg_sq": vs[name]} for name in ms}


def master_chunks(groups: list[FlatGroup]) -> dict[str, ChunkedTensor]:
    """Every parameter's float32 master weights, as this rank's chunks of the full tensor, by single-process name."""
    return {name: t for g in groups for name, t in shard_chunks(g.layout, g.rank, g.master).items()}
