"""A meter of activation memory: the bytes autograd really saves in a forward, block by block (the closed forms
it is compared with are model knowledge, in models/activations.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class SavedBytesMeter:
    """Bytes of distinct storages autograd saves during a forward, by the block (or `other`) that first saved them.

    Parameters are excluded; a storage saved by several ops counts once, where it was saved first."""

    def __init__(self, blocks: dict[str, nn.Module], params: list[torch.Tensor]) -> None:
        self.blocks, self.skip = blocks, {p.untyped_storage().data_ptr() for p in params}
        self.by_region: dict[str, int] = {}
        self._seen: set[int] = set()
        self._region = "other"

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.skip and key not in self._seen and t.device.type != "meta":
            self._seen.add(key)
            self.by_region[self._region] = self.by_region.get(self._region, 0) + storage.nbytes()
        return t

    def _enter(self, name: str):
        def hook(_module: nn.Module, _args: tuple) -> None:
            self._region = name

        return hook

    def _leave(self, _module: nn.Module, _args: tuple, _out: object) -> None:
        self._region = "other"

    @contextlib.contextmanager
    def measure(self) -> Iterator[SavedBytesMeter]:
        """Count what the forward inside the block saves; read `by_region` (and `total`) afterwards."""
        self.by_region, self._seen, self._region = {}, set(), "other"
        handles = [
            h for name, m in self.blocks.items() for h in (m.register_forward_pre_hook(self._enter(name)), m.register_forward_hook(self._leave))
        ]
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            for handle in handles:
                handle.remove()
            self._seen = set()

    @property
    def total(self) -> int:
        return sum(self.by_region.values())
