"""Receive buffers a pipeline rank keeps from step to step, one slot list per (shape, dtype).

A step's receives land in the buffers the previous step's receives used, instead of a fresh allocation
per message (on CPU an activation of 128 KiB or more is its own mmap, zero-filled page by page on first
write). A buffer is handed out again only once nothing else refers to its memory: each receive gets a
new tensor (`detach`) on the slot's storage, and the slot is free when that storage has no owner but
the slot, so a received activation that autograd saved for a later backward, a gradient a deferred
weight pass keeps, a view of either, or a transfer still in flight keeps its slot busy. What each rank
holds is the most receives that were alive at once in one step, per shape; shapes a step did not
receive are dropped at its end.
"""

from __future__ import annotations

import torch

Key = tuple[tuple[int, ...], torch.dtype]


def only_owner(base: torch.Tensor) -> bool:
    """Whether `base` is the one tensor left on its storage (no alias, view, saved tensor or transfer holds it)."""
    return torch._C._storage_Use_Count(base.untyped_storage()._cdata) == 2  # base's reference + the temporary storage object


class RecvBuffers:
    """Slots of received tensors on one device; `allocated` and `reused` count buffers made and handed out again."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.slots: dict[Key, list[torch.Tensor]] = {}
        self.taken: set[Key] = set()  # the shapes received since the last `end_step`
        self.allocated = self.reused = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor of `shape` and `dtype` that nothing else refers to, on a kept buffer when one is free."""
        key = (tuple(shape), dtype)
        self.taken.add(key)
        slot = self.slots.setdefault(key, [])
        for base in slot:
            if only_owner(base):
                self.reused += 1
                return base.detach()
        base = torch.empty(key[0], dtype=dtype, device=self.device)
        slot.append(base)
        self.allocated += 1
        return base.detach()

    def end_step(self) -> None:
        """Drop the slots of shapes this step did not receive (a new sequence length or micro-batch size)."""
        self.slots = {k: v for k, v in self.slots.items() if k in self.taken}
        self.taken = set()

    def held_bytes(self) -> int:
        return sum(b.nbytes for slot in self.slots.values() for b in slot)
