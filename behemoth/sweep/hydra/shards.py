"""A trial's model cut into shards: consecutive pieces (the embedding, each block, the head) packed while a shard's
model states (a trained parameter's value, gradient and AdamW's two moments: 16 bytes a float32 parameter; a frozen one's
value alone, 4 bytes: LoRA's base) fit half the device budget, so the shard that runs and the next one, prefetched, fit it
together. Each shard's states are one flat float32 buffer: the trained parameters' four states, then the frozen values."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from behemoth.errors import BehemothError
from behemoth.models.causal_lm import CausalLM

FIRST, LAST = "first", "last"  # the view's embedding and head pieces; a block piece is its index
STATES = 4  # parameter, gradient, exp_avg, exp_avg_sq


@dataclass(frozen=True)
class Shard:
    """Consecutive pieces of a model and the parameters they own, laid out in one flat buffer of STATES x numel."""

    index: int
    pieces: tuple[str | int, ...]
    names: tuple[str, ...]  # single-process parameter names, in the model's order
    shapes: tuple[tuple[int, ...], ...]
    borrowed: str | None = None  # a tied weight another shard owns, read here (the tied head reads the embedding's)
    frozen_names: tuple[str, ...] = ()  # parameters that do not train (LoRA's base): their values only, after the states
    frozen_shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def numel(self) -> int:
        """Elements of the trained parameters (each has STATES values in the buffer)."""
        return sum(numel_of(s) for s in self.shapes)

    @property
    def frozen_numel(self) -> int:
        return sum(numel_of(s) for s in self.frozen_shapes)

    @property
    def parameters_numel(self) -> int:
        """Elements of every parameter the shard computes with, trained or frozen (what prices a task not measured yet)."""
        return self.numel + self.frozen_numel

    @property
    def buffer_numel(self) -> int:
        return STATES * self.numel + self.frozen_numel

    def offsets(self) -> list[int]:
        return running_offsets(self.shapes, 0)

    def frozen_offsets(self) -> list[int]:
        """Where each frozen parameter's value starts in the shard's buffer."""
        return running_offsets(self.frozen_shapes, STATES * self.numel)

    def locations(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Every parameter's value in the shard's buffer: name -> (offset, shape)."""
        trained = zip(self.names, self.offsets(), self.shapes)
        frozen = zip(self.frozen_names, self.frozen_offsets(), self.frozen_shapes)
        return {name: (offset, shape) for name, offset, shape in (*trained, *frozen)}


def running_offsets(shapes: tuple[tuple[int, ...], ...], start: int) -> list[int]:
    out, at = [], start
    for shape in shapes:
        out.append(at)
        at += numel_of(shape)
    return out


@dataclass(frozen=True)
class ShardPlan:
    """Every shard of one model, the budget it was cut for, and the bytes a shard holds while it runs."""

    shards: tuple[Shard, ...]
    budget_bytes: int | None
    borrowed_numel: int = 0  # the tied weight's elements (its value, and its gradient when it trains, come along with the last shard)
    order: dict[str, int] = field(default_factory=dict)  # parameter name -> its position in the model's named_parameters
    borrowed_trains: bool = True  # False: the tied weight is frozen (LoRA): no gradient comes with it

    def resident_bytes(self, shard: Shard) -> int:
        """Bytes of model states a worker holds while `shard` runs (its flat buffer, and a borrowed weight with its gradient)."""
        return 4 * (shard.buffer_numel + (self.borrowed_copies * self.borrowed_numel if shard.borrowed else 0))

    @property
    def borrowed_copies(self) -> int:
        return 2 if self.borrowed_trains else 1

    @property
    def state_bytes(self) -> int:
        return sum(4 * s.buffer_numel for s in self.shards)


def numel_of(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def piece_params(lm: CausalLM, piece: str | int) -> list[str]:
    """The parameter names a piece owns (a tied weight belongs to the embedding, the first piece that holds it)."""
    view, module = lm.layers, lm.module
    roots = view.first if piece == FIRST else view.last if piece == LAST else (f"{view.blocks}.{piece}",)
    out = []
    for root in roots:
        sub = optional_submodule(module, root)
        if sub is not None:
            out += [f"{root}.{n}" for n, _ in sub.named_parameters()]
    return out


def optional_submodule(module: nn.Module, name: str) -> nn.Module | None:
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None  # behemoth's tied GPT has no lm_head module


def plan_shards(lm: CausalLM, budget_bytes: int | None) -> ShardPlan:
    """Pack the model's pieces into shards whose resident states fit budget/2 (one shard when no budget is given)."""
    named = dict(lm.module.named_parameters())  # deduplicated: a tied weight under its first name
    order = {name: i for i, name in enumerate(named)}
    for name, p in named.items():
        if p.dtype != torch.float32:
            raise BehemothError(f"hydra execution: {name} is {p.dtype}", "hydra trains float32 models (set the model's dtype to float32)")
    blocks = len(cast(nn.ModuleList, lm.module.get_submodule(lm.layers.blocks)))
    pieces: list[str | int] = [FIRST, *range(blocks), LAST]
    owned = {piece: [n for n in piece_params(lm, piece) if n in named] for piece in pieces}
    missing = set(named) - {n for names in owned.values() for n in names}
    if missing:
        raise BehemothError(f"hydra execution: parameters {sorted(missing)[:3]} belong to no embedding, block or head", "use a layered model")
    borrowed = lm.layers.embedding + ".weight" if lm.shape.tied and not any(n == "lm_head.weight" for n in owned[LAST]) else None
    borrowed_numel = named[borrowed].numel() if borrowed else 0
    trains = borrowed is None or named[borrowed].requires_grad
    limit = None if budget_bytes is None else budget_bytes // 2
    sizes = {p: 4 * sum(named[n].numel() * (STATES if named[n].requires_grad else 1) for n in owned[p]) for p in pieces}
    groups = pack(pieces, sizes, limit, 4 * (2 if trains else 1) * borrowed_numel)
    shards = []
    for i, group in enumerate(groups):
        names = [n for piece in group for n in owned[piece]]
        trained, frozen = [n for n in names if named[n].requires_grad], [n for n in names if not named[n].requires_grad]
        shards.append(
            Shard(
                i,
                tuple(group),
                tuple(trained),
                tuple(tuple(named[n].shape) for n in trained),
                borrowed if LAST in group and borrowed and FIRST not in group else None,
                tuple(frozen),
                tuple(tuple(named[n].shape) for n in frozen),
            )
        )
    return ShardPlan(tuple(shards), budget_bytes, borrowed_numel, order, trains)


def pack(pieces: list[str | int], size: dict[str | int, int], limit: int | None, last_extra: int) -> list[list[str | int]]:
    """Consecutive groups of pieces, each a piece while the group's bytes stay within `limit` (the head's group also
    holds the borrowed tied weight: `last_extra`)."""
    groups: list[list[str | int]] = [[]]
    used = 0
    for piece in pieces:
        need = size[piece] + (last_extra if piece == LAST else 0)
        if limit is not None and need > limit:
            raise BehemothError(
                f"hydra execution: piece {piece!r} holds {need / 2**20:.3f} MiB of model states, over half the device budget "
                f"({limit / 2**20:.3f} MiB: the running shard and the prefetched one share the budget)",
                f"raise sweep.hydra.budget_mb to at least {2 * need / 2**20:.3f}",
            )
        if groups[-1] and limit is not None and used + need > limit:
            groups.append([])
            used = 0
        groups[-1].append(piece)
        used += need
    return groups
