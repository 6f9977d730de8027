"""Cutting a model's layered view (embedding, blocks, head) into pipeline stages balanced by cost.

A stage is a contiguous run of transformer blocks; stage 0 also holds the embedding and the last
stage the final norm and language-model head. `stage_boundaries` are fence posts over the blocks,
[0, b1, ..., n_layer]: stage s holds blocks b[s] .. b[s+1]-1. The balancer is a pure function of
per-layer costs (estimated FLOPs, measured seconds, or plain layer counts): it minimizes the cost
of the costliest stage, so a large vocabulary's head leaves the last stage fewer blocks.

The cut keeps the single-process module names: the rank's model is the same module object, run
through its model's `LayeredView` (models/layered.py), with only its own blocks (`StageBlocks`,
registered under their original indices), embedding and head, so layout-independent
initialization, DCP checkpoints and `behemoth export` see the names they expect. With tied
embeddings the first and the last stage both hold the embedding weight; the pipeline sums the two
copies' gradients before the data-parallel reduction (Megatron's embedding group) so they stay equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from behemoth.errors import BehemothError
from behemoth.models.layered import LayeredView
from behemoth.models.shape import LayerCosts


def balance_stages(costs: LayerCosts, stages: int) -> list[int]:
    """Fence posts cutting the blocks into `stages` non-empty runs that minimize the costliest stage.

    Stage 0 also pays `costs.embed` and the last stage `costs.head`. Among cuts with the same
    maximum, the one with the smallest sum of squared stage costs wins (the most even).
    """
    n = len(costs.blocks)
    if not 1 <= stages <= n:
        raise BehemothError(
            f"{stages} pipeline stages for {n} blocks: every stage needs at least one block", f"use at most {n} stages, or a deeper model"
        )
    prefix = [0.0]
    for c in costs.blocks:
        prefix.append(prefix[-1] + c)

    def stage_cost(s: int, i: int, j: int) -> float:
        return prefix[j] - prefix[i] + (costs.embed if s == 0 else 0.0) + (costs.head if s == stages - 1 else 0.0)

    inf = (float("inf"), float("inf"))
    best = [[inf] * (n + 1) for _ in range(stages)]  # best[s][j]: (max, sum of squares) for blocks [0, j) in s+1 stages
    cut = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        best[0][j] = (stage_cost(0, 0, j), stage_cost(0, 0, j) ** 2)
    for s in range(1, stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                c = stage_cost(s, i, j)
                key = (max(best[s - 1][i][0], c), best[s - 1][i][1] + c * c)
                if key < best[s][j]:
                    best[s][j], cut[s][j] = key, i
    bounds = [n]
    for s in range(stages - 1, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return [0] + bounds[::-1]


def check_stage_boundaries(bounds: Sequence[int], n_layer: int, stages: int) -> None:
    """Refuse boundaries that are not [0, ..., n_layer] in strictly increasing order with one per stage."""
    fix = f"give {stages + 1} increasing block indices from 0 to {n_layer}, e.g. {even_boundaries(n_layer, stages)}, or leave it unset"
    if len(bounds) != stages + 1:
        raise BehemothError(f"parallel.stage_boundaries={list(bounds)} has {len(bounds)} entries for {stages} stages", fix)
    if bounds[0] != 0 or bounds[-1] != n_layer:
        raise BehemothError(f"parallel.stage_boundaries={list(bounds)} must start at 0 and end at model.n_layer={n_layer}", fix)
    if any(b >= a for a, b in zip(bounds[1:], bounds[:-1])):
        raise BehemothError(f"parallel.stage_boundaries={list(bounds)} is not strictly increasing: every stage needs a block", fix)


def even_boundaries(n_layer: int, stages: int) -> list[int]:
    """Equal block counts, the remainder going to the later stages."""
    return [s * n_layer // stages for s in range(stages + 1)] if 1 <= stages <= n_layer else [0, n_layer]


def stage_costs(costs: LayerCosts, bounds: Sequence[int]) -> list[float]:
    """The cost of each stage under `bounds` (embedding on the first, head on the last)."""
    stages = len(bounds) - 1
    return [
        sum(costs.blocks[bounds[s] : bounds[s + 1]]) + (costs.embed if s == 0 else 0.0) + (costs.head if s == stages - 1 else 0.0)
        for s in range(stages)
    ]


# ---------------------------------------------------------------- cutting the module tree


class StageBlocks(nn.Module):
    """The blocks one rank holds, registered under their single-process indices (`blocks.5.attn...`)."""

    def __init__(self, blocks: dict[int, nn.Module]) -> None:
        super().__init__()
        for index in sorted(blocks):
            self.add_module(str(index), blocks[index])

    def __getitem__(self, index: int) -> nn.Module:
        return self._modules[str(index)]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)


class PipelineStage:
    """One pipeline stage on this rank: a view over the cut model that runs blocks [first, last) and,
    on the first stage, the embedding, on the last, the head. It owns no modules."""

    def __init__(self, model: nn.Module, stage: int, bounds: Sequence[int], view: LayeredView, tied: bool = False) -> None:
        self.model, self.stage, self.view, self.tied = model, stage, view, tied
        self.blocks = range(bounds[stage], bounds[stage + 1])
        self.is_first, self.is_last = stage == 0, stage == len(bounds) - 2
        self.seq_split = 1  # sequence parallelism: a later stage's input is 1/seq_split of the sequence
        # context parallelism: the global positions [batch, tokens] of the tokens a micro-batch's input holds (None: 0..T-1)
        self.positions: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids -> hidden states (first stage), hidden -> hidden, or hidden -> logits (last stage)."""
        view, model = self.view, self.model
        positions = None if self.positions is None else self.positions(x if self.is_first else full_sequence_like(x, self.seq_split))
        h = view.embed(model, x, positions) if self.is_first else x
        if len(self.blocks):
            whole = h if self.is_first else full_sequence_like(h, self.seq_split)  # the first stage splits in block 0
            blocks, context = model.get_submodule(view.blocks), view.context(model, whole, positions)
            for i in self.blocks:
                h = view.block(blocks[i], h, context)
        return view.head(model, h) if self.is_last else h

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The (single-process name, parameter) pairs this stage uses; looked up now, so valid after materialize."""
        view = self.view
        prefixes = [f"{view.blocks}.{i}." for i in self.blocks]
        prefixes += [f"{m}." for m in view.first] if self.is_first else []
        prefixes += [f"{m}." for m in view.last] + ([f"{view.embedding}."] if self.tied else []) if self.is_last else []
        return [(n, p) for n, p in self.model.named_parameters() if n.startswith(tuple(prefixes))]

    def parameters(self) -> list[nn.Parameter]:
        return [p for _, p in self.named_parameters()]


def full_sequence_like(h: torch.Tensor, seq_split: int) -> torch.Tensor:
    """Hidden states of the full sequence's shape (a view, no memory) for a stage whose input is a sequence-parallel
    shard: positions, causal masks and rotary embeddings are built for the whole sequence, as on the first stage."""
    if seq_split == 1:
        return h
    return h.detach()[:, :1].expand(h.shape[0], h.shape[1] * seq_split, *h.shape[2:])


def _drop(model: nn.Module, name: str) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, None)


def cut_model(
    model: nn.Module, held_stages: Sequence[int], bounds: Sequence[int], view: LayeredView, tied: bool = False, *, streamed: bool = False
) -> dict[int, PipelineStage]:
    """Keep only the parts of `model` (on the meta device) that the stages in `held_stages` use; `tied`: the head
    reads the embedding's weight, so the last stage keeps the embedding module too (`streamed`: every module of the
    embedding unit, so that its copy is cut into the first stage's shards, offload/stage_tied.py)."""
    stages = len(bounds) - 1
    first, last = 0 in held_stages, stages - 1 in held_stages
    blocks = model.get_submodule(view.blocks)
    keep = {i: blocks[i] for s in held_stages for i in range(bounds[s], bounds[s + 1])}
    model.set_submodule(view.blocks, StageBlocks(keep))
    for name in view.first if not first else ():
        if not (last and tied and (streamed or name == view.embedding)):
            _drop(model, name)
    for name in view.last if not last else ():
        _drop(model, name)
    return {s: PipelineStage(model, s, bounds, view, tied) for s in sorted(held_stages)}
