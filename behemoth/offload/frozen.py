"""A frozen base streamed straight from its model folder: a unit's shard read from the safetensors files at each fetch.

A LoRA base never changes, so its units need no scratch copy: with `offload.params=disk` and `hf.weights`, each
fetch reads this rank's shard of the unit from the folder's files with plain reads (models/safetensors_io.py: no
memory map, so nothing stays in the process's resident set but the shard), converting to float32 as the in-memory
run does. A parameter that fills its part of the shard whole, already float32, is read straight into it. Nothing is
ever written: no write-back, no gradient, no optimizer state.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from behemoth.errors import BehemothError
from behemoth.models.init import FULL_NAME, FULL_SHAPE, TAKE_LOCAL
from behemoth.models.safetensors_io import StoredTensor, read_index, read_into, read_tensor
from behemoth.parallel.zero.layout import FlatLayout
from behemoth.parallel.zero.tiers import Tier
from behemoth.parallel.zero.units import UnitSpec


class FolderWeights:
    """A save_pretrained folder's tensors by name, read one at a time with plain file reads (a `ValueSource`)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        files = sorted(Path(folder).expanduser().glob("*.safetensors"))
        if not files:
            raise BehemothError(
                f"hf.weights={folder} holds no *.safetensors file", "save the model with save_pretrained(..., safe_serialization=True)"
            )
        self.index = read_index(files)

    def entry(self, name: str) -> StoredTensor:
        if name not in self.index:
            raise BehemothError(f"hf.weights={self.folder} lacks parameter {name}", "save the whole model")
        return self.index[name]

    def __call__(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The full tensor `name` in float32."""
        return read_tensor(self.entry(name)).float()


@dataclass(frozen=True)
class PieceRead:
    """Where one parameter's piece of a shard comes from: its stored tensor and the cut that leaves the piece."""

    entry: StoredTensor
    full_shape: tuple[int, ...]
    take_local: Callable[[torch.Tensor], torch.Tensor] | None  # None: the piece is the whole stored tensor
    offset: int  # in the shard
    numel: int


class FolderShards:
    """Reads a frozen unit's shard from the folder at every fetch; counts the bytes as the parameters' tier's reads."""

    def __init__(self, weights: FolderWeights, counter: Tier) -> None:
        self.weights, self.counter = weights, counter

    def plan(self, spec: UnitSpec, layout: FlatLayout, rank: int) -> FrozenShard:
        """The reads of this rank's shard of `spec`, taken from the meta parameters `shard_parameters` left (before
        the runtime removes them)."""
        reads = []
        for pc in layout.pieces(rank):
            meta = getattr(*spec.locations[pc.index][0])
            entry = self.weights.entry(getattr(meta, FULL_NAME, spec.names[pc.index]))
            numel = math.prod(entry.shape)  # the piece is the whole stored tensor (no tensor-parallel or ZeRO cut)
            whole = pc.start == 0 and pc.stop == numel == math.prod(layout.shapes[pc.index])
            cut = None if whole else getattr(meta, TAKE_LOCAL, lambda t, a=pc.start, b=pc.stop: t.reshape(-1)[a:b])
            reads.append(PieceRead(entry, tuple(getattr(meta, FULL_SHAPE, entry.shape)), cut, pc.shard_offset, pc.numel))
        return FrozenShard(reads, layout.shard_size, self.counter)


class FrozenShard:
    """One frozen unit's shard as reads from the folder: `read()` gives it in float32, as the in-memory run holds it."""

    def __init__(self, reads: list[PieceRead], shard_size: int, counter: Tier) -> None:
        self.reads, self.shard_size, self.counter = reads, shard_size, counter

    def read(self) -> torch.Tensor:
        shard = torch.zeros(self.shard_size)
        for r in self.reads:
            out = shard[r.offset : r.offset + r.numel]
            if r.take_local is None and r.entry.dtype == torch.float32:
                read_into(r.entry, out)
            else:  # another dtype, or the cut shard_parameters made (tensor-parallel part, then this rank's piece)
                full = read_tensor(r.entry).float().reshape(r.full_shape)
                out.copy_(full.reshape(-1) if r.take_local is None else r.take_local(full).reshape(-1))
        self.counter.count(read=sum(r.entry.nbytes for r in self.reads))
        return shard
