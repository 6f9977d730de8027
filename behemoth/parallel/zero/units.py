"""ZeRO-3 units: which parameters are all-gathered together, and for which part of forward and backward.

A unit is one flat layout (layout.py) of which each rank keeps a 1/N shard. The model is cut where the
pipeline cuts it (`LayerNames`, i.e. models/layered.py's layered view of behemoth's GPT or a Hugging Face
model: embedding modules, the ModuleList of blocks, head modules):

- the embedding unit (token and position embeddings): gathered for the embedding's forward only; a
  lookup's backward needs no weights (its gradient is a scatter-add), so it is not gathered again;
- one unit per block: gathered for the block's forward and again for its backward;
- the head unit (final norm, LM head): gathered for the head's forward and backward;
- a root unit for any parameter outside those, gathered for the whole forward.

A mixture of experts shards its expert weights over a group of its own (dp; every other parameter over
dp x ep): `shard_parameters(..., experts=ExpertUnits(is_expert, group))` gives each block with experts a
second unit, gathered and freed with the first over the experts' group; the module that reads them (the
MoE layer: the stacked experts are read, not called) installs them when a recomputation needs them.

A tied LM head reads the embedding's weight. That weight stays in the embedding unit (one shard, one
master, one gradient), which the head gathers again for its forward and backward (`reads`); the
gradients of the two uses are summed before the unit's one reduce-scatter.

A frozen base (LoRA: `frozen_only=True`) puts only parameters without gradients in units: a frozen unit is
gathered and freed like any other, but has no gradient, no reduce-scatter and no optimizer state; the trainable
parameters (the adapters) stay whole on their modules, outside every unit, for a sync of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn

from behemoth.comm import CommMeter, Pending, all_gather, reduce_scatter
from behemoth.models.init import FULL_NAME, FULL_SHAPE, TAKE_LOCAL, mark_partial
from behemoth.parallel.zero.layout import FlatLayout

Location = tuple[nn.Module, str]
Role = Literal["root", "embedding", "block", "head"]


class LayerNames(Protocol):
    """Where a model keeps its parts, by module name (pipeline/views.py's `LayeredView` is one)."""

    first: tuple[str, ...]  # embedding modules
    blocks: str  # the ModuleList of blocks
    last: tuple[str, ...]  # head modules (final norm, LM head)


@dataclass(eq=False)
class UnitSpec:
    """A unit's role, its block module (block units), its parameters (single-process name, shape, every place it is
    registered) and the other units whose parameters its forward also reads (a tied head reads the embedding)."""

    role: Role
    module: nn.Module | None = None
    names: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    locations: list[list[Location]] = field(default_factory=list)
    reads: list[UnitSpec] = field(default_factory=list)
    group: dist.ProcessGroup | None = None  # sharded over this group (None: the sync's group)
    callers: list[nn.Module] = field(default_factory=list)  # modules whose forward reads these parameters (default: their owners)
    frozen: bool = False  # no parameter of the unit takes a gradient (a LoRA base): gathered for compute only

    def install(self, layout: FlatLayout, full: torch.Tensor) -> None:
        """Every parameter registered as a view of the unit's gathered flat buffer `full`, wherever the model reads it
        (fresh views: each backward graph its own). In-memory ZeRO-3 and offload's streamer install units this way."""
        for view, shape, locations in zip(full.split(layout.split_sizes()), layout.shapes, self.locations):
            for module, attr in locations:
                setattr(module, attr, view.view(shape))

    def uninstall(self) -> None:
        """The views `install` registered removed (the parameters exist only as the unit's shard again)."""
        for locations in self.locations:
            for module, attr in locations:
                if attr in module.__dict__:
                    delattr(module, attr)


def gather_unit(
    shard: torch.Tensor, layout: FlatLayout, group: dist.ProcessGroup, meter: CommMeter | None = None, *, async_op: bool = False
) -> tuple[torch.Tensor, Pending]:
    """A unit's full flat parameters, all-gathered from every rank's shard into a new buffer, and the gather."""
    full = torch.empty(layout.padded, dtype=shard.dtype, device=shard.device)
    return full, all_gather(full, shard, group, meter, async_op=async_op)


def reduce_scatter_unit(
    grad: torch.Tensor, layout: FlatLayout, rank: int, group: dist.ProcessGroup, meter: CommMeter | None = None, *, async_op: bool = False
) -> Pending:
    """A unit's full flat gradient summed over ranks, in place: this rank's shard lands in grad[lo:hi]."""
    lo, hi = layout.shard_range(rank)
    return reduce_scatter(grad[lo:hi], grad, group, meter, async_op=async_op)


class UnitRuntime:
    """What a ZeRO-3 unit does wherever its shard is stored (parallel/zero/tiers.py: device, host, disk): gather its
    flat parameters (async), install them where the model reads them, uninstall them, reduce-scatter its gradient.
    In-memory ZeRO-3 (sharded.py, the device tier) and offload's streamer (host or disk, with prefetch and
    write-back) run these same steps; a unit sets `spec`, `layout`, `group`, `rank` and `meter`."""

    spec: UnitSpec
    layout: FlatLayout
    group: dist.ProcessGroup
    rank: int
    meter: CommMeter | None
    installed: bool = False

    def gather(self, shard: torch.Tensor, *, async_op: bool = False) -> tuple[torch.Tensor, Pending]:
        """The unit's full flat parameters, all-gathered from every rank's `shard` into a new buffer, and the gather."""
        return gather_unit(shard, self.layout, self.group, self.meter, async_op=async_op)

    def install(self, full: torch.Tensor) -> None:
        """Every parameter registered as a view of the gathered buffer `full` wherever the model reads it."""
        self.spec.install(self.layout, full)
        self.installed = True

    def uninstall(self) -> None:
        """The views removed: the parameters exist only as the unit's shard again."""
        if self.installed:
            self.spec.uninstall()
            self.installed = False

    def reduce_scatter(self, grad: torch.Tensor, *, async_op: bool = False) -> Pending:
        """The full flat gradient summed over ranks, in place: this rank's shard lands in `shard_of(grad)`."""
        return reduce_scatter_unit(grad, self.layout, self.rank, self.group, self.meter, async_op=async_op)

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a flat tensor of the unit's padded layout."""
        lo, hi = self.layout.shard_range(self.rank)
        return full[lo:hi]


@dataclass(frozen=True)
class ExpertUnits:
    """Which parameters (by single-process name) are expert weights, and the group their units are sharded over."""

    is_expert: Callable[[str], bool]
    group: dist.ProcessGroup


def split_expert_units(model: nn.Module, specs: list[UnitSpec], experts: ExpertUnits) -> list[UnitSpec]:
    """Each block unit holding expert weights becomes two, its experts' one over `experts.group`, read by their owner's parent."""
    names = {id(m): n for n, m in model.named_modules()}
    out = []
    for spec in specs:
        picked = [i for i, name in enumerate(spec.names) if experts.is_expert(name)]
        if spec.role != "block" or not picked:
            out.append(spec)
            continue
        rest = [i for i in range(len(spec.names)) if i not in picked]
        part = lambda idx, **kw: UnitSpec(
            spec.role,
            spec.module,
            [spec.names[i] for i in idx],
            [spec.shapes[i] for i in idx],  # noqa: E731
            [spec.locations[i] for i in idx],
            frozen=spec.frozen,
            **kw,
        )
        owners = {names[id(m)].rpartition(".")[0] for i in picked for m, _ in spec.locations[i]}
        out += [part(rest), part(picked, group=experts.group, callers=[model.get_submodule(n) for n in sorted(owners)])]
    return [s for s in out if s.names]


def _submodules(model: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    """The modules `names` name (a name that resolves to nothing, such as an absent tied lm_head, is skipped)."""
    out = []
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        if isinstance(module, nn.Module):
            out.append(module)
    return out


def plan_units(model: nn.Module, *, layers: LayerNames, tie_embeddings: bool = False, frozen_only: bool = False) -> list[UnitSpec]:
    """Assign every parameter to the innermost unit that contains it: root, embedding, blocks (forward order), head.
    `frozen_only`: only parameters without gradients (a frozen base); trainable ones are left out of every unit."""
    blocks = list(model.get_submodule(layers.blocks))
    specs = [UnitSpec("root"), UnitSpec("embedding"), *(UnitSpec("block", b) for b in blocks), UnitSpec("head")]
    anchor = {id(model): 0}
    anchor.update({id(m): 1 for m in _submodules(model, layers.first)})
    anchor.update({id(b): 2 + i for i, b in enumerate(blocks)})
    anchor.update({id(m): len(specs) - 1 for m in _submodules(model, layers.last)})
    seen: dict[int, tuple[int, int]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        unit = _owning_unit(model, mod_name, anchor)
        for attr, p in module.named_parameters(recurse=False):
            if frozen_only and p.requires_grad:
                continue
            if id(p) in seen:  # registered again: a tied weight
                u, i = seen[id(p)]
                if u != unit:
                    if (specs[u].role, specs[unit].role) != ("embedding", "head"):
                        raise ValueError(f"parameter {specs[u].names[i]} is shared between two ZeRO-3 units ({specs[u].role}, {specs[unit].role})")
                    specs[unit].reads.append(specs[u])
                specs[u].locations[i].append((module, attr))
                continue
            spec = specs[unit]
            seen[id(p)] = (unit, len(spec.names))
            spec.names.append(getattr(p, FULL_NAME, f"{mod_name}.{attr}" if mod_name else attr))
            spec.shapes.append(tuple(p.shape))
            spec.locations.append([(module, attr)])
    if tie_embeddings:  # a tied head may read the embedding's weight without registering it (behemoth's GPT does)
        specs[-1].reads.append(specs[1])
    kept = [s for s in specs if s.names]
    for s in kept:
        s.reads = [r for r in {id(r): r for r in s.reads}.values() if r.names]
        s.frozen = frozen_only
    return kept


def _owning_unit(model: nn.Module, mod_name: str, anchor: dict[int, int]) -> int:
    """Index of the innermost unit module on the path to `mod_name`."""
    unit, module = 0, model
    for part in mod_name.split(".") if mod_name else []:
        module = getattr(module, part)
        unit = anchor.get(id(module), unit)
    return unit


def shard_parameters(
    model: nn.Module,
    group: dist.ProcessGroup,
    *,
    layers: LayerNames,
    tie_embeddings: bool = False,
    experts: ExpertUnits | None = None,
    frozen_only: bool = False,
) -> list[UnitSpec]:
    """Before materialize: replace each meta parameter by this rank's 1-D piece of it, marked partial.

    `materialize` then draws each full parameter from (seed, name) and keeps only the piece, so a rank never
    stores more than its shard; weights loaded from a file (hf.weights) go through the same `take_local`.
    `frozen_only`: only the frozen parameters are sharded (a LoRA base); the trainable ones stay whole.
    """
    specs = plan_units(model, layers=layers, tie_embeddings=tie_embeddings, frozen_only=frozen_only)
    if experts is not None:
        specs = split_expert_units(model, specs, experts)
    for spec in specs:
        world, rank = dist.get_world_size(spec.group or group), dist.get_rank(spec.group or group)
        layout = FlatLayout(spec.names, spec.shapes, world)
        pieces = {p.index: p for p in layout.pieces(rank)}
        for i, locations in enumerate(spec.locations):
            old = getattr(*locations[0])
            name, shape = getattr(old, FULL_NAME, spec.names[i]), getattr(old, FULL_SHAPE, spec.shapes[i])
            piece = pieces.get(i)
            if piece is None:  # nothing of this parameter on this rank: nothing to draw or load
                new = nn.Parameter(torch.empty(0), requires_grad=old.requires_grad)
                mark_partial(new, name, shape, lambda full: full.reshape(-1)[:0])
            else:
                new = nn.Parameter(torch.empty(piece.numel, device="meta"), requires_grad=old.requires_grad)
                inner = getattr(old, TAKE_LOCAL, lambda t: t)
                mark_partial(new, name, shape, lambda full, inner=inner, a=piece.start, b=piece.stop: inner(full).reshape(-1)[a:b])
            for module, attr in locations:
                setattr(module, attr, new)
    return specs
