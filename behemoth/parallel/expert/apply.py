"""apply_expert_parallel: each rank keeps E / ep experts of every MoE layer and computes them for the whole ep group.

Applied on the meta model after tensor parallelism: every stacked expert weight is replaced by this rank's
part of it (its experts, and under tp its slice of each expert's width, `layout.py`), marked so that
`materialize` draws the full (seed, name) tensor and keeps that part, and each MoE layer gets a runner
that dispatches its rows to the experts' ranks (`dispatch.py`). Names do not change.

What it leaves behind (`ExpertParallel`) tells the rest of the system what is different about experts:
- `is_expert(name)`: expert weights are distinct on each ep rank, so their gradients are synchronised
  over dp only, while every other parameter (attention, router, norms) is replicated over dp x ep;
- `copies(name)`: ranks holding an identical copy of an expert gradient piece (tp, unless it is split
  over tp too), for the clipping norm;
- `checkpoint_views`: expert tensors at their full-tensor offsets, for DCP (single-process names);
- `set_layout(layout, chunks)`: the layout in force, switchable between steps (parameters do not move).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from behemoth.errors import BehemothError
from behemoth.models.init import mark_partial
from behemoth.models.moe import ExpertRunner, MoELayer
from behemoth.parallel.chunked import checkpoint_views
from behemoth.parallel.expert.comm import EPComm
from behemoth.parallel.expert.dispatch import AllToAllExperts, ExpertCompute, GatherExperts, OwnedExperts
from behemoth.parallel.expert.layout import EXPERT_LAYOUT, ExpertShard
from behemoth.parallel.tensor.comm import TPComm, scatter_seq

Layout = Literal["alltoall", "gather"]
LAYOUTS: tuple[str, ...] = ("alltoall", "gather")
INFERENCE_LAYOUTS: tuple[str, ...] = ("owned", *LAYOUTS)  # owned: rows alike on every ep rank (dispatch.py), not for training


@dataclass(frozen=True)
class ExpertPolicy:
    """The expert layout to start with: tokens to the experts (`alltoall`, pipelined in `chunks`) or experts to the tokens."""

    layout: Layout = "alltoall"
    chunks: int = 1


class ExpertParallel:
    """This rank's MoE layers and what expert parallelism changes for syncs, clipping, checkpoints and layouts."""

    def __init__(self, layers: dict[str, MoELayer], ep: EPComm, tp: TPComm | None, policy: ExpertPolicy) -> None:
        self.layers, self.ep, self.tp = layers, ep, tp
        self.compute = ExpertCompute(tp)
        self.shards: dict[str, ExpertShard] = {}
        for name, layer in layers.items():
            experts = getattr(layer, layer.spec.experts)
            for attr in (layer.spec.w_in, layer.spec.w_out):
                self.shards[f"{name}.{layer.spec.experts}.{attr}"] = getattr(getattr(experts, attr), EXPERT_LAYOUT)
        self.layout, self.chunks = policy.layout, policy.chunks
        self.set_layout(policy.layout, policy.chunks)

    def is_expert(self, name: str) -> bool:
        return name in self.shards

    def copies(self, name: str) -> int:
        """tp ranks holding an identical copy of this expert weight's gradient: 1 when its width is split over tp."""
        tp = self.tp.size if self.tp is not None else 1
        return 1 if self.shards[name].width_dim is not None else tp

    def set_layout(self, layout: str, chunks: int = 1) -> None:
        """Compute every MoE layer's experts in `layout` from the next forward on (collective: every rank the same)."""
        if layout not in INFERENCE_LAYOUTS or chunks < 1:
            raise BehemothError(
                f"expert layout {layout!r} with {chunks} chunk(s) is not one of {', '.join(INFERENCE_LAYOUTS)} with chunks >= 1",
                "use parallel.expert_layout=alltoall or gather, parallel.expert_chunks >= 1 (owned: generation only)",
            )
        runner: ExpertRunner = AllToAllExperts(self.ep, self.compute, chunks)
        if layout != "alltoall":
            runner = GatherExperts(self.ep, self.compute) if layout == "gather" else OwnedExperts(self.ep, self.compute)
        for layer in self.layers.values():
            layer.runner = runner
        self.layout, self.chunks = layout, chunks

    def checkpoint_views(self, state: dict[str, Any]) -> dict[str, Any]:
        """Engine state with expert tensors (whole or ZeRO's chunks) as full-shape views, for DCP."""
        return checkpoint_views(state, self.shards)


def shard_experts(layer: MoELayer, name: str, ep: EPComm, tp: TPComm | None) -> None:
    """Replace the layer's stacked expert weights by this rank's part (experts over ep, widths over tp)."""
    spec, experts = layer.spec, getattr(layer, layer.spec.experts)
    t, t_rank = (tp.size, tp.rank) if tp is not None else (1, 0)
    if spec.num_experts % ep.size:
        raise BehemothError(f"{name}: {spec.num_experts} experts do not split over ep={ep.size}", f"use an ep that divides {spec.num_experts}")
    for attr, width_dim, parts in ((spec.w_in, 1, 2 if spec.gated else 1), (spec.w_out, 2, 1)):
        old = getattr(experts, attr)
        width = old.shape[width_dim] // parts
        if width % t:
            raise BehemothError(f"{name}.{spec.experts}.{attr}: expert width {width} does not split over tp={t}", f"use a tp that divides {width}")
        shard = ExpertShard.of(tuple(old.shape), ep=ep.size, ep_rank=ep.rank, tp=t, tp_rank=t_rank, width_dim=width_dim, parts=parts)
        if old.is_meta:
            new = nn.Parameter(torch.empty(shard.local_shape, dtype=old.dtype, device="meta"), requires_grad=old.requires_grad)
            mark_partial(new, f"{name}.{spec.experts}.{attr}", shard.full_shape, shard.take_local)
        else:
            new = nn.Parameter(shard.take_local(old.detach()), requires_grad=old.requires_grad)
        setattr(new, EXPERT_LAYOUT, shard)
        setattr(experts, attr, new)


def apply_expert_parallel(
    model: nn.Module, ep: EPComm, policy: ExpertPolicy, *, layers: tuple[str, ...], tp: TPComm | None = None, sequence_parallel: bool = False
) -> ExpertParallel:
    """Split the experts of the MoE layers `layers` names (those this rank holds) over `ep`, and over `tp` their widths.
    `sequence_parallel`: an MoE layer runs on the whole sequence (its input norm gathered it, tp plan style
    `sequence_replicate`), and its output, whole on every tp rank, re-enters the SP region as this rank's shard."""
    present = {n for n, _ in model.named_modules()}
    held = {name: model.get_submodule(name) for name in layers if name in present}
    for name, layer in held.items():
        if not isinstance(layer, MoELayer):
            raise BehemothError(f"{name} is a {type(layer).__name__}, not an MoE layer", "list only the model's MoE layers")
        shard_experts(layer, name, ep, tp)
        if sequence_parallel and tp is not None and tp.size > 1:
            layer.register_forward_hook(lambda _m, _args, out, tp=tp: scatter_seq(out, tp))
    return ExpertParallel(held, ep, tp, policy)


def plan_expert_parallel(model: nn.Module, degree: int, *, layers: tuple[str, ...], tp: int = 1) -> ExpertParallel:
    """The experts `apply_expert_parallel` keeps on a rank of a `degree`-wide ep group (widths split over `tp`), without
    the groups: for the planner, on the meta device (every ep rank holds equal shapes; the result runs no collective)."""
    return apply_expert_parallel(
        model,
        EPComm(None, degree, 0),
        ExpertPolicy(),
        layers=layers,  # type: ignore[arg-type]
        tp=TPComm(None, tp, 0) if tp > 1 else None,
    )  # type: ignore[arg-type]  # size and rank only
