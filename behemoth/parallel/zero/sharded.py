"""ZeRO stage 3: each rank stores only its shard of every parameter; units are gathered on demand.

A *unit* (units.py) is the embedding, a transformer block, the head, or the root (anything else). Its
parameters live in one padded flat layout of which each rank keeps a 1/N shard, stored on the device tier
(tiers.py); gather, install, uninstall and reduce-scatter are the unit runtime's (`UnitRuntime`), the same
steps offload's streamer runs for a unit whose shard is on the host or disk tier.

- forward: a unit is *entered* when its part of the forward starts: the model's pre-hook enters the
  root and the embedding, the first block's pre-hook leaves the embedding, each block's hooks enter and
  leave it, the last block's post-hook enters the head (and, for a tied head, the embedding again) and
  the model's post-hook leaves what is left. Entering waits for the unit's all-gather (issued ahead as a
  prefetch, or now), installs its parameters as views of the gathered buffer and issues the all-gathers
  of the next `prefetch` units so that communication runs while this unit computes; leaving removes
  the views and drops the buffer. The gather is the forward of an autograd Function (`GatherParams`)
  whose backward reduce-scatters the unit's gradient.
- saved tensors: autograd would keep every gathered weight alive until backward. A saved-tensor
  hook replaces any view of a gathered buffer by (unit, size, stride, offset); unpacking it in
  backward all-gathers the unit again (prefetching the next unit in backward order) and rebuilds
  the view. So the buffer is really freed after forward and gathered again before backward.
- backward: once a unit's gradient is complete, `GatherParams.backward` starts its reduce-scatter
  (in place, asynchronously, overlapped with the next unit's backward), frees the gathered buffer,
  and the summed shard is added to the persistent gradient shard when the reduce-scatter is done.
  A unit entered twice (the tied embedding) sums the gradients of its uses and reduce-scatters once.
- a frozen unit (a LoRA base, `UnitSpec.frozen`) keeps only its shard in the compute dtype: no float32 master, no
  gradient, no reduce-scatter, no optimizer state. It is installed without `GatherParams` (nothing flows back to
  it), re-gathered in backward by the saved-tensor hook like any unit, and, since no gradient says when its part of
  backward is over, freed once backward re-gathers a unit after it in backward order (or at `finish`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from behemoth.comm import CommMeter, Pending
from behemoth.parallel.zero.groups import BufferMeter, FlatGroup
from behemoth.parallel.zero.tiers import DeviceTier, Tier
from behemoth.parallel.zero.units import UnitRuntime, UnitSpec


class SavedView:
    """What autograd keeps instead of a view of a gathered buffer: enough to rebuild it after a re-gather."""

    __slots__ = ("unit", "size", "stride", "offset")

    def __init__(self, unit: ShardedUnit, t: torch.Tensor) -> None:
        self.unit, self.size, self.stride, self.offset = unit, t.size(), t.stride(), t.storage_offset()


class GatherParams(torch.autograd.Function):
    """Forward: the unit's gathered flat parameters. Backward: reduce-scatter of their gradient."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, unit: ShardedUnit) -> torch.Tensor:
        ctx.unit = unit
        return unit.gathered()

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[None, None]:
        ctx.unit.reduce_scatter_grads(grad_full)
        return None, None


class ShardedUnit(FlatGroup, UnitRuntime):
    """One unit's shard (float32 master on its tier, compute copy, gradient) and its gather/free life cycle."""

    def __init__(
        self, spec: UnitSpec, group: dist.ProcessGroup, stage3: Stage3, *, key: str, compute_dtype: torch.dtype, meter: CommMeter | None
    ) -> None:
        super().__init__(spec.names, spec.shapes, group, compute_dtype=compute_dtype, meter=meter)
        self.spec, self.stage3, self.frozen = spec, stage3, spec.frozen
        device = stage3.tier.device
        stage3.tier.allocate(key, self.layout.shard_size, compute_dtype if self.frozen else torch.float32)
        self.master = stage3.tier.fetch(key)  # the device tier hands out the stored tensor itself
        for piece in self.layout.pieces(self.rank):
            local = getattr(*spec.locations[piece.index][0])
            self.master[piece.shard_offset : piece.shard_offset + piece.numel].copy_(local.detach())
        for locations in spec.locations:
            for module, attr in locations:
                delattr(module, attr)
        self.shard = self.master if self.master.dtype == compute_dtype else self.master.to(compute_dtype)
        self.grad_shard = torch.zeros(0 if self.frozen else self.layout.shard_size, dtype=compute_dtype, device=device)
        self.anchor = torch.empty(0, device=device, requires_grad=True)  # puts GatherParams in the graph
        self.buffer: torch.Tensor | None = None
        self.pending: Pending | None = None
        self.reads: list[ShardedUnit] = []  # units this one's forward also needs (Stage3 links them)
        self.uses = 0  # entries in this forward whose gradient has not come back yet
        self.grad_sum: torch.Tensor | None = None  # gradients of the uses that came back, while others are pending

    def start_gather(self) -> None:
        """Issue the all-gather of this unit's parameters (no-op if gathered or in flight)."""
        if self.buffer is not None:
            return
        self.buffer, self.pending = self.gather(self.shard, async_op=True)
        self.stage3.gathered_bytes.add(self.buffer)

    def gathered(self) -> torch.Tensor:
        """The full flat parameters, waiting for the all-gather if needed."""
        self.start_gather()
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            self.stage3.live[id(self.buffer)] = self
        return self.buffer

    def release(self) -> None:
        """Drop this unit's gathered buffer; its memory returns once no view of it is left."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
        if self.buffer is not None:
            self.stage3.live.pop(id(self.buffer), None)
            self.stage3.gathered_bytes.drop(self.buffer)
            self.buffer = None

    def reduce_scatter_grads(self, grad_full: torch.Tensor) -> None:
        """A use's gradient is complete: free the parameters; once every use's gradient is in, start summing
        their sum over ranks (this rank's shard lands in place)."""
        grad = grad_full.to(self.compute_dtype).contiguous()
        self.stage3.grad_bytes.add(grad)
        if self.grad_sum is not None:
            grad, self.grad_sum = self.grad_sum.add_(grad), None
        self.uses -= 1
        self.uninstall()  # views installed by a recomputation in backward
        self.release()
        if self.uses > 0:  # a tied weight: its other use's gradient is still to come
            self.grad_sum = grad
            return
        self.start_reduce_scatter(grad)

    def start_reduce_scatter(self, grad: torch.Tensor) -> None:
        """Sum the full gradient over ranks, asynchronously; at most one other unit's stays in flight."""
        pending = self.reduce_scatter(grad, async_op=True)
        self.stage3.in_flight.append((pending, self, grad))
        self.stage3.drain(keep=1)

    def publish(self) -> None:
        if self.shard is not self.master:
            self.shard.copy_(self.master)
        return None


class Stage3:
    """Hooks that gather, free and prefetch units around forward and backward, and the reduce-scatters in flight."""

    def __init__(
        self, model: nn.Module, specs: list[UnitSpec], group: dist.ProcessGroup, *, prefetch: int, compute_dtype: torch.dtype, meter: CommMeter | None
    ) -> None:
        self.prefetch = prefetch
        self.gathered_bytes, self.grad_bytes = BufferMeter(), BufferMeter()
        self.live: dict[int, ShardedUnit] = {}
        self.in_flight: list[tuple[Pending, ShardedUnit, torch.Tensor]] = []
        self.tier: Tier = DeviceTier(next(getattr(*locs[0]) for s in specs for locs in s.locations).device)  # where the shards live
        self.units = [ShardedUnit(s, s.group or group, self, key=f"p.{i}", compute_dtype=compute_dtype, meter=meter) for i, s in enumerate(specs)]
        of_spec = {id(u.spec): u for u in self.units}
        for unit in self.units:
            unit.reads = [of_spec[id(r)] for r in unit.spec.reads]
        role = {r: [u for u in self.units if u.spec.role == r] for r in ("root", "embedding", "block", "head")}
        blocks, head = role["block"], role["head"]
        # forward: root and embedding at the model's start, the head after the last block (at the start without blocks)
        self.at_start = role["root"] + role["embedding"] + ([] if blocks else head)
        self.forward_order = role["root"] + role["embedding"] + blocks + head
        # backward: the embedding's lookup needs no weights; a tied head reads them again
        self.backward_order = [r for h in head for r in h.reads] + head + blocks[::-1]
        self.entered: list[ShardedUnit] = []
        self._saved_hooks: Any = None
        model.register_forward_pre_hook(self._model_start)
        model.register_forward_hook(self._model_end, always_call=True)
        for i, unit in enumerate(blocks):
            unit.spec.module.register_forward_pre_hook(self._block_start(unit, role["embedding"] if i == 0 else []))
            unit.spec.module.register_forward_hook(self._block_end(unit, head if i == len(blocks) - 1 else []), always_call=True)
        for unit in self.units:
            owners = {id(m): m for m in unit.spec.callers} or {id(m): m for locations in unit.spec.locations for m, _ in locations}
            for owner in owners.values():
                owner.register_forward_pre_hook(self._ensure_installed(unit))

    def enter(self, unit: ShardedUnit, prefetch: bool = True) -> None:
        """Install the unit's gathered parameters for its part of the forward (a use whose gradient will come back)."""
        if unit in self.entered:
            return
        full = unit.gathered() if unit.frozen else GatherParams.apply(unit.anchor, unit)
        if torch.is_grad_enabled() and not unit.frozen:
            unit.uses += 1
        unit.install(full)
        self.entered.append(unit)
        if prefetch:
            self.prefetch_after(unit, self.forward_order)
        for other in unit.reads:
            self.enter(other, prefetch=False)

    def leave(self, units: list[ShardedUnit]) -> None:
        """Remove the units' parameters and drop their gathered buffers."""
        for unit in units:
            if unit in self.entered:
                self.entered.remove(unit)
                unit.uninstall()
                unit.release()

    def _model_start(self, module: nn.Module, args: Any) -> None:
        for unit in self.units:
            unit.uses, unit.grad_sum = 0, None
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._saved_hooks.__enter__()
        for unit in self.at_start:
            self.enter(unit)

    def _model_end(self, module: nn.Module, args: Any, output: Any) -> None:
        self.leave(list(self.entered))
        if self._saved_hooks is not None:
            self._saved_hooks.__exit__(None, None, None)
            self._saved_hooks = None

    def _block_start(self, unit: ShardedUnit, done: list[ShardedUnit]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.leave(done)  # the first block: the embedding's part of the forward is over
            self.enter(unit)

        return hook

    def _block_end(self, unit: ShardedUnit, then: list[ShardedUnit]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.leave([unit])
            for nxt in then:  # the last block: the head's part of the forward begins
                self.enter(nxt)

        return hook

    def _ensure_installed(self, unit: ShardedUnit) -> Callable[..., None]:
        """Activation recomputation re-runs a block's forward in backward, without the block's own hooks:
        the first layer that needs the parameters gathers and installs them (freed when the gradient is done)."""

        def hook(module: nn.Module, args: Any) -> None:
            if not unit.installed:  # views that require grad, as in forward, so the same tensors are saved
                unit.install(unit.gathered().detach().requires_grad_(torch.is_grad_enabled() and not unit.frozen))
                self.retire_frozen(unit)
                self.prefetch_after(unit, self.backward_order)

        return hook

    def prefetch_after(self, unit: ShardedUnit, order: list[ShardedUnit]) -> None:
        """Issue the all-gathers of the next `prefetch` units in `order` (with the units they read)."""
        if unit not in order:
            return
        i = order.index(unit)
        for nxt in order[i + 1 : i + 1 + self.prefetch]:
            for u in (nxt, *nxt.reads):
                u.start_gather()

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
            self.retire_frozen(unit)
            self.prefetch_after(unit, self.backward_order)
        else:
            full = unit.buffer
        return full.as_strided(saved.size, saved.stride, saved.offset)

    def retire_frozen(self, unit: ShardedUnit) -> None:
        """Backward re-gathered `unit`: frozen units before it in backward order are done (no gradient tells when)."""
        if unit not in self.backward_order:
            return
        for done in self.backward_order[: self.backward_order.index(unit)]:
            if done.frozen and done.buffer is not None and done.pending is None:
                done.uninstall()
                done.release()

    def drain(self, keep: int = 0) -> None:
        """Finish reduce-scatters until at most `keep` are in flight, adding each shard into its unit's gradient."""
        while len(self.in_flight) > keep:
            pending, unit, grad = self.in_flight.pop(0)
            pending.wait()
            unit.grad_shard.add_(grad[unit.lo : unit.hi])
            self.grad_bytes.drop(grad)

    def finish(self) -> None:
        """End of backward: every reduce-scatter done, every gathered buffer dropped."""
        for unit in self.units:
            if unit.grad_sum is not None:  # another use's gradient never came back (its output did not reach the loss)
                grad, unit.grad_sum = unit.grad_sum, None
                unit.start_reduce_scatter(grad)
        self.drain()
        for unit in self.units:
            if unit.frozen:  # views a recomputation installed: no gradient removed them
                unit.uninstall()
            unit.release()
