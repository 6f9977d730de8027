"""The sharded optimizer: AdamW over this rank's pieces of every parameter, float32 master weights.

Each rank steps only the elements of its shards, so its Adam moments (and, with bf16 compute, its
float32 master weights) cover Ψ/N elements. The step is adam.py's, on the flat master shard and its
moments, piece by piece: the same AdamW offload takes where its state lives (offload/store.py), so there
is one sharded AdamW whatever the tier. The groups then publish the new values to the compute parameters
(a copy to bf16 and/or an all-gather). Weight decay follows the single-process rule (parallel/sync.py `decays`).
"""

from __future__ import annotations

import torch

from behemoth.comm import Pending
from behemoth.parallel.chunked import ChunkedTensor, chunked
from behemoth.parallel.sync import AdamWSettings, Optimizer
from behemoth.parallel.zero.adam import AdamFP32, shard_pieces
from behemoth.parallel.zero.groups import FlatGroup
from behemoth.parallel.zero.layout import FlatLayout


class ShardedAdamW(Optimizer):
    """AdamW on this rank's shard of every flat group; `param_groups` and `step()` behave like torch's optimizer."""

    def __init__(self, groups: list[FlatGroup], settings: AdamWSettings) -> None:
        self.groups = groups
        self.adam = AdamFP32(settings)
        self.pieces = [shard_pieces(g.layout, g.rank) for g in groups]
        self.moments = [
            {k: torch.zeros(g.layout.shard_size, dtype=torch.float32, device=g.master.device) for k in ("m", "v")} for g in groups
        ]  # created now (zero, step 0) so that a checkpoint can be loaded before the first step
        self.step_tensor = torch.tensor(0.0)  # the step count, as torch's AdamW keeps it (a checkpoint loads into it)
        self.param_groups: list[dict] = [{"lr": settings.lr}]

    @torch.no_grad()
    def step(self) -> None:
        """Update the master shards from the gradient shards, then publish them to the compute parameters."""
        self.step_tensor += 1
        count, lr = int(self.step_tensor.item()), self.param_groups[0]["lr"]
        for g, pieces, state in zip(self.groups, self.pieces, self.moments):
            grad = g.grad_shard if g.grad_shard.dtype == torch.float32 else g.grad_shard.float()
            self.adam.step(g.master, grad, state, pieces, lr=lr, coef=1.0, step=count)
        self.publish()

    @torch.no_grad()
    def publish(self) -> None:
        """Compute parameters := master weights, on every rank (all-gathers overlap each other)."""
        pending = [g.publish() for g in self.groups]
        for work in pending:
            if isinstance(work, Pending):
                work.wait()

    def state_bytes(self) -> int:
        """Bytes of optimizer state: Adam moments, plus float32 master weights when they are a separate copy."""
        moments = sum(t.numel() * t.element_size() for state in self.moments for t in state.values())
        masters = sum(g.master.numel() * g.master.element_size() for g in self.groups if g.master.dtype != g.compute_dtype)
        return moments + masters

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Adam state keyed by single-process names, as this rank's chunks (for DCP)."""
        optim: dict[str, dict[str, torch.Tensor]] = {}
        for g, state in zip(self.groups, self.moments):
            optim.update(moment_chunks(g.layout, g.rank, state["m"], state["v"], self.step_tensor))
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
