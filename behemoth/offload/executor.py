"""Runs one step's order (order.py) over the units: fetch, gather, compute, evict, with prefetch.

For each action the units it needs are resident: their shards were read by an I/O thread (prefetched
up to `prefetch` stays ahead, in plan order), all-gathered over the data-parallel group, and installed
as views of one flat buffer that is a leaf of autograd, so that every backward through the unit adds
into that buffer's gradient. When a stay ends the views go, the gradient is reduce-scattered to this
rank's shard and handed on: complete (the runtime steps it or keeps it for a deferred step) or partial
(written to the gradient tier, read back and added at the unit's next stay).

The gather, install, uninstall and reduce-scatter are the unit runtime's (parallel/zero/units.py
`UnitRuntime`), as in in-memory ZeRO-3; what the streamer adds is where the shard waits (a tier) and when it moves.

Activations: the input of every block, for every micro-batch, is kept (activations at block boundaries);
a block's forward runs without autograd and is recomputed from its kept input in backward, with the
random state of its forward replayed (parallel/recompute.py), so dropout draws the same masks. Peak
activation memory is the boundaries plus one block's recomputation, whatever the model's size.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from behemoth.models.layered import LayeredView
from behemoth.offload.io import IOPool
from behemoth.offload.order import Action, Residency, needs, plan_residencies
from behemoth.offload.store import PendingStep, UnitStore
from behemoth.parallel.recompute import RngState, recompute_backward, replayed_rng, save_rng

Batch = list[tuple[torch.Tensor, torch.Tensor]]
Positions = dict[int, torch.Tensor]  # micro-batch -> the global positions [B, T/cp] of its tokens (context parallelism)


class StepHooks(Protocol):
    """What the runtime decides for the streamer: a step owed at fetch, and what a complete gradient does."""

    def take_pending(self, store: UnitStore) -> PendingStep | None: ...

    def gradient_complete(self, store: UnitStore, shard: torch.Tensor, grad: torch.Tensor) -> None: ...


@dataclass
class Loaded:
    """A resident unit: its shard as fetched, its full flat parameters, the gradient that waited for it."""

    store: UnitStore
    shard: torch.Tensor
    flat: torch.Tensor
    waiting: torch.Tensor | None


class BoundaryPass:
    """One pass's compute with activations at block boundaries: per micro-batch, each block's input (and, training, its
    gradient, context and random state) kept between actions; a block's forward runs without autograd and its backward
    recomputes it from the kept input (parallel/recompute.py)."""

    def __init__(
        self, model: nn.Module, view: LayeredView, blocks: list[nn.Module], device: torch.device, positions: Positions | None = None
    ) -> None:
        self.model, self.view, self.blocks, self.device = model, view, blocks, device
        self.positions = positions or {}  # context parallelism: each micro-batch's global token positions (None: 0 .. T-1)
        self.hidden: dict[tuple[int, int], torch.Tensor] = {}
        self.grads: dict[tuple[int, int], torch.Tensor] = {}
        self.ctx: dict[int, Any] = {}
        self.rng: dict[tuple[int, int], RngState] = {}
        self.weight_grads: dict[tuple[int, int], torch.Tensor] = {}  # a BI pass's output gradient, kept for its W
        self.embedding_ends_ctx = True  # the embedding's backward drops its micro-batch's context (the stage streamer drops it itself)

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.hidden, self.grads, self.weight_grads) for t in d.values())

    def forward(self, a: Action, x: torch.Tensor, autocast: Callable, keep_rng: bool = True) -> None:
        """A unit's forward without autograd; its output is the next block's kept input."""
        if keep_rng:
            self.rng[(a.unit, a.mb)] = save_rng(self.device)
        with torch.no_grad(), autocast():
            if a.unit == 0:
                h = self.view.embed(self.model, x, self.positions.get(a.mb))
                self.ctx[a.mb] = self.view.context(self.model, h, self.positions.get(a.mb))
            else:
                h = self.view.block(self.blocks[a.unit - 1], self.hidden[(a.unit - 1, a.mb)], self.ctx[a.mb])
        self.hidden[(a.unit, a.mb)] = h

    def head_logits(self, a: Action, autocast: Callable) -> torch.Tensor:
        """The head's forward on the last block's kept output (no autograd: evaluation, generation)."""
        with autocast():
            return self.view.head(self.model, self.hidden.pop((a.unit - 1, a.mb)))

    def head_backward(self, a: Action, y: torch.Tensor, loss_fn: Callable, autocast: Callable) -> torch.Tensor:
        """The head's forward, the loss and its backward at once; keeps the gradient of the head's input."""
        h = self.hidden.pop((a.unit - 1, a.mb)).detach().requires_grad_()
        with autocast():
            logits = self.view.head(self.model, h)
        loss = loss_fn(logits, y)
        loss.backward()
        self.grads[(a.unit - 1, a.mb)] = h.grad
        return loss.detach()

    def train(self, a: Action, batch: tuple[torch.Tensor, torch.Tensor], loss_fn: Callable, autocast: Callable) -> torch.Tensor | None:
        """One training visit of a unit for a micro-batch (`batch`: its inputs and targets): a forward, the head's forward
        and backward (its loss returned), or a recomputed backward."""
        x, y = batch
        if a.kind == "F":
            self.forward(a, x, autocast)
        elif a.kind == "FB":
            return self.head_backward(a, y, loss_fn, autocast)
        elif a.kind == "BI":
            self.backward_input(a, autocast)
        elif a.kind == "W":
            self.backward_weight(a, autocast)
        else:
            self.backward(a, x, autocast)
        return None

    def backward(self, a: Action, x: torch.Tensor, autocast: Callable) -> None:
        """A block's (or the embedding's) forward recomputed from its kept input, then its backward."""
        grad_out, rng = self.grads.pop((a.unit, a.mb)), self.rng.pop((a.unit, a.mb))
        if a.unit == 0:
            at = self.positions.get(a.mb)  # the recomputation embeds at the forward's positions
            recompute_backward(lambda ids: self.view.embed(self.model, ids, at), x, grad_out, rng, context=autocast, input_grad=False)
            if self.embedding_ends_ctx:
                self.ctx.pop(a.mb, None)
            return
        block, ctx = self.blocks[a.unit - 1], self.ctx[a.mb]
        h = self.hidden.pop((a.unit - 1, a.mb))
        self.grads[(a.unit - 1, a.mb)] = recompute_backward(lambda inp: self.view.block(block, inp, ctx), h, grad_out, rng, context=autocast)

    def backward_input(self, a: Action, autocast: Callable) -> None:
        """A block's input-gradient pass (zero-bubble's B): its forward recomputed from the kept input with its forward's
        random state, then the gradient of that input alone (no weight gradient is computed or accumulated); the input,
        the random state and the output's gradient stay for the block's weight pass."""
        if a.unit == 0:
            raise ValueError("the embedding has no input gradient: the first stage's weight pass is its full backward")
        grad_out, block, ctx = self.grads.pop((a.unit, a.mb)), self.blocks[a.unit - 1], self.ctx[a.mb]
        x = self.hidden[(a.unit - 1, a.mb)].detach().requires_grad_()
        with replayed_rng(self.rng[(a.unit, a.mb)], grad_out.device), autocast():
            out = self.view.block(block, x, ctx)
        (self.grads[(a.unit - 1, a.mb)],) = torch.autograd.grad(out, x, grad_out)
        self.weight_grads[(a.unit, a.mb)] = grad_out

    def backward_weight(self, a: Action, autocast: Callable) -> None:
        """A block's weight-gradient pass (zero-bubble's W): its forward recomputed again from the kept input, then the
        backward of its weights alone (into the unit's flat gradient), with the output gradient its input pass kept."""
        grad_out, rng = self.weight_grads.pop((a.unit, a.mb)), self.rng.pop((a.unit, a.mb))
        block, ctx = self.blocks[a.unit - 1], self.ctx[a.mb]
        h = self.hidden.pop((a.unit - 1, a.mb))
        recompute_backward(lambda inp: self.view.block(block, inp, ctx), h, grad_out, rng, context=autocast, input_grad=False)


class Streamer:
    """Executes orders over a model's units, streaming them from their tiers."""

    def __init__(
        self,
        model: nn.Module,
        view: LayeredView,
        stores: list[UnitStore],
        reads: dict[int, tuple[int, ...]],
        *,
        io: IOPool,
        prefetch: int,
        device: torch.device,
        hooks: StepHooks,
    ) -> None:
        self.model, self.view, self.stores, self.reads = model, view, stores, reads
        self.blocks = list(model.get_submodule(view.blocks))
        self.io, self.prefetch, self.device, self.hooks = io, prefetch, device, hooks  # each unit gathers over its own group
        self.resident: dict[int, Loaded] = {}
        self.peak_activation_bytes = 0

    # --- one step ---

    def train(
        self,
        actions: list[Action],
        micro_batches: Batch,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        autocast: Callable[[], contextlib.AbstractContextManager],
        positions: Positions | None = None,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch in the order of `actions`; the sum of their (scaled) losses."""
        state, total = BoundaryPass(self.model, self.view, self.blocks, self.device, positions), torch.zeros((), device=self.device)
        batches = [(x.to(self.device), y.to(self.device)) for x, y in micro_batches]

        def compute(a: Action) -> None:
            nonlocal total
            loss = state.train(a, batches[a.mb], loss_fn, autocast)
            total = total if loss is None else total + loss
            self.peak_activation_bytes = max(self.peak_activation_bytes, state.held_bytes())

        self.run(actions, compute)
        return total

    @torch.no_grad()
    def forward_only(
        self,
        actions: list[Action],
        inputs: list[torch.Tensor],
        on_logits: Callable[[int, torch.Tensor], None],
        autocast: Callable[[], contextlib.AbstractContextManager],
        positions: Positions | None = None,
    ) -> None:
        """Every input through each unit in turn (forward order); `on_logits(i, logits)` as the head produces each."""
        state = BoundaryPass(self.model, self.view, self.blocks, self.device, positions)
        moved = [x.to(self.device) for x in inputs]

        def compute(a: Action) -> None:
            if a.kind == "F":
                state.forward(a, moved[a.mb], autocast, keep_rng=False)
            else:
                on_logits(a.mb, state.head_logits(a, autocast))

        self.run(actions, compute)

    # --- residency: fetch, gather, install, evict ---

    def run(self, actions: list[Action], compute: Callable[[Action], None]) -> None:
        """Each action with the units it needs resident; stays fetched ahead in plan order, evicted after their last action."""
        plan = plan_residencies(actions, self.reads)
        ends: dict[int, list[Residency]] = defaultdict(list)
        for stay in plan.stays:
            ends[stay.last].append(stay)
        self.queue, self.next = plan.stays, 0  # stays in begin order; the first not begun yet
        self.fetches: dict[int, Any] = {}  # id(stay) -> its fetch job, for stays submitted and not begun
        self.fetching: set[int] = set()  # units with such a stay
        try:
            for i, action in enumerate(actions):
                for stay in plan.by_action[i]:
                    self.begin(stay)
                self.fill()
                self.install(action)
                compute(action)
                for stay in ends[i]:
                    self.end(stay)
                self.fill()
        finally:
            for unit in list(self.resident):
                self.uninstall(unit)
            self.resident.clear()

    def fill(self) -> None:
        """Submit the fetches of the next stays, up to `prefetch` ahead, in order; a unit's next stay is not read
        before its current one is evicted (the eviction may write what it reads)."""
        for stay in self.queue[self.next : self.next + self.prefetch]:
            if id(stay) in self.fetches:
                continue
            if stay.unit in self.resident or stay.unit in self.fetching:
                return
            self.submit(stay)

    def submit(self, stay: Residency) -> None:
        store = self.stores[stay.unit]
        with_grad = stay.partial_in and stay.grads and not store.frozen  # a frozen unit wrote no partial gradient to read back
        self.fetches[id(stay)] = self.io.submit(stay.unit, store.load, self.hooks.take_pending(store), with_grad)
        self.fetching.add(stay.unit)

    def begin(self, stay: Residency) -> None:
        """The stay's shard (fetched), all-gathered into the unit's flat parameters."""
        assert self.queue[self.next] is stay, "stays begin in plan order"
        self.next += 1
        if id(stay) not in self.fetches:
            self.submit(stay)
        self.fetching.discard(stay.unit)
        shard, waiting = self.io.wait(self.fetches.pop(id(stay)))
        store = self.stores[stay.unit]
        compute = store.compute_shard(shard)
        full = store.gather(compute)[0] if store.layout.world > 1 else compute
        self.resident[stay.unit] = Loaded(store, shard, full.detach().requires_grad_(stay.grads and not store.frozen), waiting)

    def install(self, action: Action) -> None:
        """Fresh views of the flat parameters wherever the model reads them (fresh: each backward graph its own)."""
        for unit in needs(action, self.reads):
            loaded = self.resident[unit]
            loaded.store.install(loaded.flat)

    def uninstall(self, unit: int) -> None:
        self.stores[unit].uninstall()

    def end(self, stay: Residency) -> None:
        """Evict: views removed; the stay's gradient summed over ranks to this rank's shard and handed on."""
        loaded = self.resident.pop(stay.unit)
        self.uninstall(stay.unit)
        if not stay.grads or loaded.store.frozen:  # a frozen unit is read-only: nothing to reduce or write back
            return
        store, grad = loaded.store, loaded.flat.grad
        if grad is None:  # the unit took no part in this rank's loss: it still joins the sum
            grad = torch.zeros(store.layout.padded, dtype=store.compute_dtype, device=self.device)
        loaded.flat.grad = None
        if store.layout.world > 1:
            store.reduce_scatter(grad)
            grad = store.shard_of(grad).clone()
        if loaded.waiting is not None:
            grad.add_(loaded.waiting)
        if stay.completes:
            self.hooks.gradient_complete(store, loaded.shard, grad)
        else:
            store.grad_waiting = True
            self.io.submit(stay.unit, store.save_grad, grad)
