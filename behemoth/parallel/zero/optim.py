"""The sharded optimizer: AdamW over this rank's pieces of every parameter, float32 master weights.

Each rank steps only the elements of its shards, so its Adam moments (and, with bf16 compute, its
float32 master weights) cover Ψ/N elements. A piece is a 1-D view into the group's master shard,
so torch's AdamW updates the master in place; the groups then publish the new values to the
compute parameters (a copy to bf16 and/or an all-gather). Weight decay follows the single-process
rule (matrices and embeddings only), decided on the full parameter's shape.
"""

from __future__ import annotations

import torch
from torch import nn

from behemoth.comm import Pending
from behemoth.parallel.chunked import ChunkedTensor, chunked
from behemoth.parallel.sync import AdamWSettings, Optimizer, adamw_with_state, decays
from behemoth.parallel.zero.groups import FlatGroup
from behemoth.parallel.zero.layout import Piece


class ShardedAdamW(Optimizer):
    """AdamW on this rank's shard pieces; `param_groups` and `step()` behave like torch's optimizer."""

    def __init__(self, groups: list[FlatGroup], settings: AdamWSettings) -> None:
        self.groups = groups
        self.entries: list[tuple[FlatGroup, Piece, nn.Parameter]] = []
        decay: list[nn.Parameter] = []
        no_decay: list[nn.Parameter] = []
        for g in groups:
            for piece in g.layout.pieces(g.rank):
                p = nn.Parameter(g.master[piece.shard_offset:piece.shard_offset + piece.numel])  # aliases the master
                (decay if decays(g.layout.shapes[piece.index]) else no_decay).append(p)
                self.entries.append((g, piece, p))
        self.inner = adamw_with_state(decay, no_decay, settings)  # state created now so that checkpoints load into it
        self.param_groups: list[dict] = self.inner.param_groups if self.inner else []

    @property
    def state(self) -> dict:
        return self.inner.state if self.inner else {}

    @torch.no_grad()
    def step(self) -> None:
        """Update the master shards from the gradient shards, then publish them to the compute parameters."""
        if self.inner is not None:
            grads = {id(g): g.grad_shard if g.grad_shard.dtype == torch.float32 else g.grad_shard.float() for g in self.groups}
            for g, piece, p in self.entries:
                p.grad = grads[id(g)][piece.shard_offset:piece.shard_offset + piece.numel]
            self.inner.step()
            for _, _, p in self.entries:
                p.grad = None
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
        moments = sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values() if t.dim() > 0)
        masters = sum(g.master.numel() * g.master.element_size() for g in self.groups if g.master.dtype != g.compute_dtype)
        return moments + masters

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Adam state keyed by single-process names, as this rank's chunks (for DCP)."""
        optim: dict[str, dict[str, torch.Tensor]] = {}
        held = {(id(g), piece.index): (piece, p) for g, piece, p in self.entries}
        any_step = next(iter(self.state.values()))["step"] if self.state else torch.tensor(0.0)
        for g in self.groups:
            for i, (name, shape) in enumerate(zip(g.layout.names, g.layout.shapes)):
                piece, p = held.get((id(g), i), (None, None))
                if piece is None:
                    zero = chunked(g.master[:0], 0, 0, shape)
                    optim[name] = {"step": any_step, "exp_avg": zero, "exp_avg_sq": zero}
                    continue
                state = self.state[p]
                optim[name] = {"step": state["step"], **{k: chunked(state[k], piece.start, piece.stop, shape) for k in ("exp_avg", "exp_avg_sq")}}
        return optim


def master_chunks(groups: list[FlatGroup]) -> dict[str, ChunkedTensor]:
    """Every parameter's float32 master weights, as this rank's chunks of the full tensor, by single-process name."""
    out: dict[str, ChunkedTensor] = {}
    for g in groups:
        pieces = {pc.index: pc for pc in g.layout.pieces(g.rank)}
        for i, (name, shape) in enumerate(zip(g.layout.names, g.layout.shapes)):
            pc = pieces.get(i)
            out[name] = (chunked(g.master[:0], 0, 0, shape) if pc is None
                         else chunked(g.master[pc.shard_offset:pc.shard_offset + pc.numel], pc.start, pc.stop, shape))
    return out
