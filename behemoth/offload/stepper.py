"""When a streamed unit takes its optimizer step, and the squared gradient norm summed on the way (offload.step).

- fused (train.grad_clip = 0): a unit steps on an I/O thread as soon as its gradient is complete, during
  backward; no gradient outlives its unit's stay.
- deferred (exact clipping): a complete gradient goes to the gradient tier and its squared norm into a sum;
  after backward the model's clip (parallel/clip.py) turns the all-reduced sum into the clipping coefficient, and each unit
  takes its step (with that coefficient and the step's learning rate) when it is next fetched: at the next
  step's forward, at an evaluation, or at a flush before a checkpoint. The step is the same arithmetic as in
  memory (clip, then AdamW), so losses and weights equal in-memory training's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from behemoth.offload.io import IOPool
from behemoth.offload.store import PendingStep, UnitStore
from behemoth.parallel.clip import weighted_square


class UnitSteps:
    """The streamer's step hooks (executor.py `StepHooks`): a complete gradient counted into the norm, then its unit stepped
    (fused) or its gradient kept for the step it owes (deferred); owed steps handed to the fetch that applies them."""

    def __init__(
        self, stores: list[UnitStore], io: IOPool, *, fused: bool, device: torch.device, tp: Any = None, copies: Callable[[str], int] | None = None
    ) -> None:
        self.stores, self.io, self.fused, self.tp = stores, io, fused, tp
        self.copies = copies or (tp.copies if tp is not None else None)  # tp ranks holding a copy of a gradient, by name
        self.lr: Callable[[], float] = lambda: 0.0  # the optimizer's learning rate now (set when it is built)
        self.step_count, self.norm_sq, self.coef = 0, torch.zeros((), dtype=torch.float32, device=device), 1.0
        self.nonfinite = False  # a gradient of this step was not finite: no fused step from then on
        self.completed: list[UnitStore] = []

    def new_step(self) -> None:
        """No gradient norm yet, no unit completed."""
        self.norm_sq.zero_()
        self.nonfinite = False
        self.completed = []

    def take_pending(self, store: UnitStore) -> PendingStep | None:
        """The step `store` owes, handed to the fetch that applies it (its gradient is then off the gradient tier)."""
        step, store.pending = store.pending, None
        if step is not None:
            store.grad_waiting = False
        return step

    def gradient_complete(self, store: UnitStore, shard: torch.Tensor, grad: torch.Tensor, *, counted: bool = True) -> None:
        """A unit's gradient is whole (summed over micro-batches and ranks): count its norm (unless another rank counts
        it: `counted`), then step it or keep it."""
        if self.tp is not None:
            self.tp.finish_grads([(store.layout.names[pc.index], grad[pc.shard_offset : pc.shard_offset + pc.numel]) for pc in store.raw_pieces])
        square = self.weighted_square(store, grad)
        if counted:
            self.norm_sq += square
        if self.fused:
            self.nonfinite = self.nonfinite or not bool(torch.isfinite(square))
            if self.nonfinite:  # the step's norm will not be finite: it applies to no further unit (the engine skips it)
                return
            self.io.submit(store.index, store.apply_step, shard, grad, PendingStep(self.lr(), 1.0, self.step_count + 1))
        else:
            store.grad_waiting = True
            self.completed.append(store)
            self.io.submit(store.index, store.save_grad, grad)

    def weighted_square(self, store: UnitStore, grad: torch.Tensor) -> torch.Tensor:
        """|g|^2 of this rank's shard, each piece weighted 1 / (tensor-parallel ranks holding a copy of it), as clip weighs
        (an expert weight split over tp by its own width split, not the dense one: `copies`)."""
        copies = self.copies
        if copies is None:
            return weighted_square([(grad, 1.0)])
        return weighted_square(
            [(grad[pc.shard_offset : pc.shard_offset + pc.numel], 1.0 / copies(store.layout.names[pc.index])) for pc in store.raw_pieces],
            grad.device,
        )

    def optimizer_step(self, lr: float) -> None:
        """After clipping: fused steps already ran; deferred ones are owed by every unit, applied at its next fetch."""
        self.step_count += 1
        if not self.fused:
            for store in self.completed:
                store.pending = PendingStep(lr, self.coef, self.step_count)
        self.completed = []

    def flush(self) -> None:
        """Apply every owed step now (before a checkpoint reads the stored shards)."""
        for store in self.stores:
            step = self.take_pending(store)
            if step is not None:
                self.io.submit(store.index, store.load, step, False)
        self.io.drain()

    def forget_owed(self) -> None:
        """A checkpoint was loaded into the stored shards: no unit owes a step or keeps a gradient."""
        for store in self.stores:
            store.pending, store.grad_waiting = None, False
