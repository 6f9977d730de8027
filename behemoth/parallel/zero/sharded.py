"""ZeRO stage 3: each rank stores only its shard of every parameter; units are gathered on demand.

A *unit* is a transformer block, or the root (embeddings, final norm and head: every parameter not
in a block). Its parameters live in one padded flat layout of which each rank keeps a 1/N shard.

- forward: a unit's forward pre-hook waits for its all-gather (issued ahead as a prefetch, or now),
  installs its parameters as views of the gathered buffer, and issues the all-gather of the next
  `prefetch` units so that communication runs while this unit computes. The post-hook removes the
  views and drops the buffer. The gather is the forward of an autograd Function (`GatherParams`)
  whose backward reduce-scatters the unit's gradient.
- saved tensors: autograd would keep every gathered weight alive until backward. A saved-tensor
  hook replaces any view of a gathered buffer by (unit, size, stride, offset); unpacking it in
  backward all-gathers the unit again (prefetching the next unit in backward order) and rebuilds
  the view. So the buffer is really freed after forward and gathered again before backward.
- backward: once a unit's gradient is complete, `GatherParams.backward` starts its reduce-scatter
  (in place, asynchronously, overlapped with the next unit's backward), frees the gathered buffer,
  and the summed shard is added to the persistent gradient shard when the reduce-scatter is done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from behemoth.comm import CommMeter, Pending, all_gather, reduce_scatter
from behemoth.models.init import FULL_NAME, FULL_SHAPE, TAKE_LOCAL, mark_partial
from behemoth.parallel.zero.groups import BufferMeter, FlatGroup
from behemoth.parallel.zero.layout import FlatLayout

Location = tuple[nn.Module, str]


@dataclass
class UnitSpec:
    """A unit's module and its parameters: single-process name, shape and every place it is registered."""

    module: nn.Module
    names: list[str] = field(default_factory=list)
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    locations: list[list[Location]] = field(default_factory=list)


def unit_modules(model: nn.Module) -> list[nn.Module]:
    """The root, then every transformer block (`model.blocks`), in forward order."""
    return [model, *getattr(model, "blocks", [])]


def plan_units(model: nn.Module) -> list[UnitSpec]:
    """Assign every parameter to the innermost unit that contains it (blocks first, the rest to the root)."""
    roots = unit_modules(model)
    owner_of = {id(m): i for i, m in enumerate(roots)}
    specs = [UnitSpec(m) for m in roots]
    seen: dict[int, tuple[int, int]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        unit = _owning_unit(model, mod_name, owner_of)
        for attr, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                u, i = seen[id(p)]
                if u != unit:
                    raise ValueError(f"parameter {specs[u].names[i]} is shared between two ZeRO-3 units")
                specs[u].locations[i].append((module, attr))
                continue
            spec = specs[unit]
            seen[id(p)] = (unit, len(spec.names))
            spec.names.append(getattr(p, FULL_NAME, f"{mod_name}.{attr}" if mod_name else attr))
            spec.shapes.append(tuple(p.shape))
            spec.locations.append([(module, attr)])
    return [s for s in specs if s.names]


def _owning_unit(model: nn.Module, mod_name: str, owner_of: dict[int, int]) -> int:
    """Index of the innermost unit module on the path to `mod_name`."""
    unit, module = 0, model
    for part in mod_name.split(".") if mod_name else []:
        module = getattr(module, part)
        unit = owner_of.get(id(module), unit)
    return unit


def shard_parameters(model: nn.Module, group: dist.ProcessGroup) -> list[UnitSpec]:
    """Before materialize: replace each meta parameter by this rank's 1-D piece of it, marked partial.

    `materialize` then draws each full parameter from (seed, name) and keeps only the piece, so a
    rank never stores more than its shard.
    """
    specs = plan_units(model)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    for spec in specs:
        layout = FlatLayout(spec.names, spec.shapes, world)
        pieces = {p.index: p for p in layout.pieces(rank)}
        for i, locations in enumerate(spec.locations):
            old = getattr(*locations[0])
            piece = pieces.get(i)
            if piece is None:  # nothing of this parameter on this rank: nothing to draw
                new = nn.Parameter(torch.empty(0), requires_grad=old.requires_grad)
            else:
                new = nn.Parameter(torch.empty(piece.numel, device="meta"), requires_grad=old.requires_grad)
                inner = getattr(old, TAKE_LOCAL, lambda t: t)
                mark_partial(new, getattr(old, FULL_NAME, spec.names[i]), getattr(old, FULL_SHAPE, spec.shapes[i]),
                             lambda full, inner=inner, a=piece.start, b=piece.stop: inner(full).reshape(-1)[a:b])
            for module, attr in locations:
                setattr(module, attr, new)
    return specs


class SavedView:
    """What autograd keeps instead of a view of a gathered buffer: enough to rebuild it after a re-gather."""

    __slots__ = ("unit", "size", "stride", "offset")

    def __init__(self, unit: "ShardedUnit", t: torch.Tensor) -> None:
        self.unit, self.size, self.stride, self.offset = unit, t.size(), t.stride(), t.storage_offset()


class GatherParams(torch.autograd.Function):
    """Forward: the unit's gathered flat parameters. Backward: reduce-scatter of their gradient."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, unit: "ShardedUnit") -> torch.Tensor:
        ctx.unit = unit
        return unit.gathered()

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[None, None]:
        ctx.unit.reduce_scatter_grads(grad_full)
        return None, None


class ShardedUnit(FlatGroup):
    """One unit's shard (float32 master, compute copy, gradient) and its gather/free life cycle."""

    def __init__(self, spec: UnitSpec, group: dist.ProcessGroup, stage3: "Stage3", *, compute_dtype: torch.dtype,
                 meter: CommMeter | None) -> None:
        super().__init__(spec.names, spec.shapes, group, compute_dtype=compute_dtype, meter=meter)
        self.spec, self.stage3 = spec, stage3
        first = next(getattr(*locs[0]) for locs in spec.locations)
        device = first.device
        self.master = torch.zeros(self.layout.shard_size, dtype=torch.float32, device=device)
        for piece in self.layout.pieces(self.rank):
            local = getattr(*spec.locations[piece.index][0])
            self.master[piece.shard_offset:piece.shard_offset + piece.numel].copy_(local.detach())
        for locations in spec.locations:
            for module, attr in locations:
                delattr(module, attr)
        self.shard = self.master if compute_dtype == torch.float32 else self.master.to(compute_dtype)
        self.grad_shard = torch.zeros(self.layout.shard_size, dtype=compute_dtype, device=device)
        self.anchor = torch.empty(0, device=device, requires_grad=True)  # puts GatherParams in the graph
        self.buffer: torch.Tensor | None = None
        self.pending: Pending | None = None
        self.installed = False

    def start_gather(self) -> None:
        """Issue the all-gather of this unit's parameters (no-op if gathered or in flight)."""
        if self.buffer is not None:
            return
        self.buffer = torch.empty(self.layout.padded, dtype=self.compute_dtype, device=self.shard.device)
        self.stage3.gathered_bytes.add(self.buffer)
        self.pending = all_gather(self.buffer, self.shard, self.group, self.meter, async_op=True)

    def gathered(self) -> torch.Tensor:
        """The full flat parameters, waiting for the all-gather if needed."""
        self.start_gather()
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            self.stage3.live[id(self.buffer)] = self
        return self.buffer

    def install(self, full: torch.Tensor) -> None:
        """Register each parameter as a view of the gathered buffer wherever the model expects it."""
        views = full.split(self.layout.split_sizes())
        for view, shape, locations in zip(views, self.layout.shapes, self.spec.locations):
            for module, attr in locations:
                setattr(module, attr, view.view(shape))
        self.installed = True

    def uninstall(self) -> None:
        if not self.installed:
            return
        for locations in self.spec.locations:
            for module, attr in locations:
                delattr(module, attr)
        self.installed = False

    def release(self) -> None:
        """Drop this unit's gathered buffer; its memory returns once no view of it is left."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        if self.buffer is not None:
            self.stage3.live.pop(id(self.buffer), None)
            self.buffer = None
        self.stage3.gathered_bytes.sample()

    def reduce_scatter_grads(self, grad_full: torch.Tensor) -> None:
        """Start summing the unit's gradient over ranks (this rank's shard lands in place) and free the parameters."""
        grad = grad_full.to(self.compute_dtype).contiguous()
        self.stage3.grad_bytes.add(grad)
        pending = reduce_scatter(grad[self.lo:self.hi], grad, self.group, self.meter, async_op=True)
        self.uninstall()  # views installed by a recomputation in backward
        self.release()
        self.stage3.in_flight.append((pending, self, grad))
        self.stage3.drain(keep=1)

    def publish(self) -> None:
        if self.shard is not self.master:
            self.shard.copy_(self.master)
        return None


class Stage3:
    """Hooks that gather, free and prefetch units around forward and backward, and the reduce-scatters in flight."""

    def __init__(self, model: nn.Module, specs: list[UnitSpec], group: dist.ProcessGroup, *, prefetch: int,
                 compute_dtype: torch.dtype, meter: CommMeter | None) -> None:
        self.prefetch = prefetch
        self.gathered_bytes, self.grad_bytes = BufferMeter(), BufferMeter()
        self.live: dict[int, ShardedUnit] = {}
        self.in_flight: list[tuple[Pending, ShardedUnit, torch.Tensor]] = []
        self.units = [ShardedUnit(s, group, self, compute_dtype=compute_dtype, meter=meter) for s in specs]
        self.forward_order = list(self.units)
        self.backward_order = [self.units[0], *reversed(self.units[1:])]
        self._finished: list[ShardedUnit] = []
        self._saved_hooks: Any = None
        for unit in self.units:
            is_root = unit.spec.module is model
            unit.spec.module.register_forward_pre_hook(self._pre_forward(unit, is_root))
            unit.spec.module.register_forward_hook(self._post_forward(unit, is_root), always_call=True)
            owners = {id(m): m for locations in unit.spec.locations for m, _ in locations}
            for owner in owners.values():
                owner.register_forward_pre_hook(self._ensure_installed(unit))

    def _pre_forward(self, unit: ShardedUnit, is_root: bool) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if is_root:
                self._finished = []
                self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
                self._saved_hooks.__enter__()
            full = GatherParams.apply(unit.anchor, unit)
            unit.install(full)
            self.prefetch_after(unit, self.forward_order)
        return hook

    def _post_forward(self, unit: ShardedUnit, is_root: bool) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            unit.uninstall()
            unit.release()
            self._finished.append(unit)
            if is_root:
                self._saved_hooks.__exit__(None, None, None)
                self._saved_hooks = None
                self.backward_order = list(reversed(self._finished))
        return hook

    def _ensure_installed(self, unit: ShardedUnit) -> Callable[..., None]:
        """Activation recomputation re-runs a block's forward in backward, without the block's own hooks:
        the first layer that needs the parameters gathers and installs them (freed when the gradient is done)."""
        def hook(module: nn.Module, args: Any) -> None:
            if not unit.installed:  # views that require grad, as in forward, so the same tensors are saved
                unit.install(unit.gathered().detach().requires_grad_(torch.is_grad_enabled()))
                self.prefetch_after(unit, self.backward_order)
        return hook

    def prefetch_after(self, unit: ShardedUnit, order: list[ShardedUnit]) -> None:
        """Issue the all-gathers of the next `prefetch` units in `order`."""
        i = order.index(unit)
        for nxt in order[i + 1:i + 1 + self.prefetch]:
            nxt.start_gather()

    def pack(self, t: torch.Tensor) -> Any:
        base = t._base if t._base is not None else t
        unit = self.live.get(id(base))
        return t if unit is None or unit.buffer is not base else SavedView(unit, t)

    def unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, SavedView):
            return saved
        unit = saved.unit
        if unit.buffer is None or unit.pending is not None:
            full = unit.gathered()
            self.prefetch_after(unit, self.backward_order)
        else:
            full = unit.buffer
        return full.as_strided(saved.size, saved.stride, saved.offset)

    def drain(self, keep: int = 0) -> None:
        """Finish reduce-scatters until at most `keep` are in flight, adding each shard into its unit's gradient."""
        while len(self.in_flight) > keep:
            pending, unit, grad = self.in_flight.pop(0)
            pending.wait()
            unit.grad_shard.add_(grad[unit.lo:unit.hi])
        self.grad_bytes.sample()

    def finish(self) -> None:
        """End of backward: every reduce-scatter done, every gathered buffer dropped."""
        self.drain()
        for unit in self.units:
            unit.release()
