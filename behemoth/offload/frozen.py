"""A frozen base streamed straight from its model folder: a unit's shard read from the safetensors files at each fetch.

A LoRA base never changes, so its units need no scratch copy: with `offload.params=disk` and `hf.weights`, each
fetch reads this rank's shard of the unit from the folder's files with plain reads (models/safetensors_io.py: no
memory map, so nothing stays in the process's resident set but the shard), converting to float32 as the in-memory
run does. A parameter that fills its part of the shard whole, already float32, is read straight into it. Under tensor
parallelism a split parameter's rank part is read alone (models/safetensors_io.py `read_narrow`: its rows, or its
columns row by row), so each tp rank reads 1/tp of the split weights. Nothing is ever written: no write-back, no
gradient, no optimizer state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from behemoth.errors import BehemothError
from behemoth.models.init import FULL_NAME, FULL_SHAPE, TAKE_LOCAL
from behemoth.models.safetensors_io import StoredTensor, read_index, read_into, read_narrow, read_tensor
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
    split: Any = None  # the tensor-parallel ShardLayout of the parameter (None: not split): only its part is read
    start: int = 0  # the piece's range in the flattened tensor-parallel part
    stop: int = 0


class FolderShards:
    """Reads a frozen unit's shard from the folder at every fetch; counts the bytes as the parameters' tier's reads.
    `splits`: the tensor-parallel layout (parallel/tensor/layers.py ShardLayout) of each split parameter, by name."""

    def __init__(self, weights: FolderWeights, counter: Tier, splits: Mapping[str, Any] | None = None) -> None:
        self.weights, self.counter, self.splits = weights, counter, splits or {}

    def plan(self, spec: UnitSpec, layout: FlatLayout, rank: int) -> FrozenShard:
        """The reads of this rank's shard of `spec`, taken from the meta parameters `shard_parameters` left (before
        the runtime removes them)."""
        reads = []
        for pc in layout.pieces(rank):
            meta = getattr(*spec.locations[pc.index][0])
            name = getattr(meta, FULL_NAME, spec.names[pc.index])
            entry = self.weights.entry(name)
            full_shape = tuple(getattr(meta, FULL_SHAPE, entry.shape))
            split = self.splits.get(name) if full_shape == entry.shape else None  # a stored tensor of another shape: read whole
            numel = math.prod(entry.shape)  # the piece is the whole stored tensor (no tensor-parallel or ZeRO cut)
            whole = split is None and pc.start == 0 and pc.stop == numel == math.prod(layout.shapes[pc.index])
            cut = None if whole else getattr(meta, TAKE_LOCAL, lambda t, a=pc.start, b=pc.stop: t.reshape(-1)[a:b])
            reads.append(PieceRead(entry, full_shape, cut, pc.shard_offset, pc.numel, split, pc.start, pc.stop))
        return FrozenShard(reads, layout.shard_size, self.counter)


class FrozenShard:
    """One frozen unit's shard as reads from the folder: `read()` gives it in float32, as the in-memory run holds it."""

    def __init__(self, reads: list[PieceRead], shard_size: int, counter: Tier) -> None:
        self.reads, self.shard_size, self.counter = reads, shard_size, counter

    def read(self) -> torch.Tensor:
        shard, done = torch.zeros(self.shard_size), 0
        for r in self.reads:
            out = shard[r.offset : r.offset + r.numel]
            if r.split is not None:  # this rank's tensor-parallel part alone, then its ZeRO piece
                part, n = read_split(r.entry, r.split)
                out.copy_(part.reshape(-1)[r.start : r.stop])
                done += n
                continue
            if r.take_local is None and r.entry.dtype == torch.float32:
                read_into(r.entry, out)
            else:  # another dtype, or the ZeRO cut shard_parameters made (this rank's piece)
                full = read_tensor(r.entry).float().reshape(r.full_shape)
                out.copy_(full.reshape(-1) if r.take_local is None else r.take_local(full).reshape(-1))
            done += r.entry.nbytes
        self.counter.count(read=done)
        return shard


def read_split(entry: StoredTensor, split: Any) -> tuple[torch.Tensor, int]:
    """A split parameter's tensor-parallel part in float32 (padding rows zero) read piece by piece, and the bytes read."""
    part, done = torch.zeros(split.local_shape), 0
    for start, local, length in split.pieces:
        shape = list(entry.shape)
        shape[split.dim] = length
        stored = torch.empty(shape, dtype=entry.dtype)
        done += read_narrow(entry, split.dim, start, length, stored)
        part.narrow(split.dim, local, length).copy_(stored)
    return part, done
