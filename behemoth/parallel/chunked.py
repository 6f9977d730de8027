"""A tensor of which this rank holds some chunks, as DCP-readable and -writable N-D boxes.

Used wherever a rank's part of a parameter is not a DTensor `Shard(dim)` block: tensor parallelism's
fused [q|k|v] pieces and padded vocabularies, expert shards (`checkpoint_views`, below), and ZeRO's flat
ranges. ZeRO shards a parameter (or its Adam moments) by a contiguous range of its flattened elements,
which is generally not a DTensor `Shard(dim)` block. `ChunkedTensor` describes such a range as the
few N-D boxes DCP understands (`flat_range_boxes`), each a view of the rank's own storage,
so `dcp.save` writes straight from the shard and `dcp.load` writes straight into it, and a
checkpoint keyed by single-process names reshards to any other layout, stage or process count.
It implements DCP's checkpointable protocol (the three dunder methods DTensor also implements);
it is a description for checkpointing only and supports no other tensor operation.

`checkpoint_views` gives tensor and expert parallelism one way to save a split parameter under its
single-process name and full shape: each layout says which boxes of the full tensor a rank holds
(`ShardedLayout.boxes`: a fused [q|k|v] weight has three, padding rows none; an expert shard one per
packed segment), and each rank writes its pieces at their offsets, whole or as ZeRO's chunks of them,
so DCP reshards on load into another tp or ep degree, or into one process for `behemoth export`.
DTensor cannot say "three pieces per rank" (a `_StridedShard` is written by DCP as one box).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


def flat_range_boxes(start: int, stop: int, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements [start, stop) of a row-major tensor of `shape` as N-D boxes (offsets, sizes), in order.

    A flat range is at most a partial leading row, whole rows and a partial trailing row, each of
    which recurses one dimension down; DCP stores and reshards such boxes.
    """
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    row0, col0 = divmod(start, inner)
    row1, col1 = divmod(stop, inner)
    rest = tuple(shape[1:])

    def in_row(row: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((row, *o), (1, *s)) for o, s in flat_range_boxes(a, b, rest)]

    if row0 == row1:
        return in_row(row0, col0, col1)
    boxes = []
    if col0:
        boxes += in_row(row0, col0, inner)
        row0 += 1
    if row1 > row0:
        boxes.append(((row0, *[0] * len(rest)), (row1 - row0, *rest)))
    if col1:
        boxes += in_row(row1, 0, col1)
    return boxes


class ChunkedTensor(torch.Tensor):
    """A global tensor's shape and dtype, plus this rank's chunks of it (views into its shard)."""

    _chunks: list[tuple[torch.Size, torch.Tensor]]

    @staticmethod
    def __new__(
        cls, shape: tuple[int, ...], chunks: Sequence[tuple[tuple[int, ...], torch.Tensor]], *, dtype: torch.dtype, device: torch.device
    ) -> ChunkedTensor:
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device)
        r._chunks = [(torch.Size(offsets), t) for offsets, t in chunks]
        return r

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise TypeError(f"ChunkedTensor only describes checkpoint chunks; {func} is not supported")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, t.shape), properties=props, size=self.shape),
            )
            for offsets, t in self._chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets, t.shape) for offsets, t in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, t in self._chunks:
            if offsets == index.offset:
                return t
        raise ValueError(f"{index.fqn}: this rank holds no chunk at offset {tuple(index.offset or ())}")

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return f"ChunkedTensor(shape={tuple(self.shape)}, chunks={[(tuple(o), tuple(t.shape)) for o, t in self._chunks]})"


def chunked(flat: torch.Tensor, start: int, stop: int, shape: tuple[int, ...]) -> ChunkedTensor:
    """Elements [start, stop) of a tensor of `shape`, held in the 1-D `flat`, as a ChunkedTensor."""
    if flat.numel() != stop - start:
        raise ValueError(f"flat piece has {flat.numel()} elements for range [{start}, {stop})")
    chunks, pos = [], 0
    for offsets, sizes in flat_range_boxes(start, stop, shape):
        n = math.prod(sizes)
        chunks.append((offsets, flat[pos : pos + n].view(sizes)))
        pos += n
    return ChunkedTensor(shape, chunks, dtype=flat.dtype, device=flat.device)


Chunk = tuple[torch.Size, torch.Tensor]  # offsets in the full (or local) tensor, a view of this rank's storage
Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # (offsets in the full tensor, offsets in the local one, sizes)


class ShardedLayout(Protocol):
    """This rank's part of a full tensor as boxes of it (`ShardLayout` for tp, `ExpertShard` for ep)."""

    @property
    def full_shape(self) -> tuple[int, ...]: ...

    @property
    def local_shape(self) -> tuple[int, ...]: ...

    def boxes(self) -> list[Box]: ...


def narrow_box(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """The view of `t` at `offsets` of `sizes`."""
    for dim, (o, s) in enumerate(zip(offsets, sizes)):
        t = t.narrow(dim, o, s)
    return t


def local_chunks(tensor: torch.Tensor) -> list[Chunk]:
    """A rank-local tensor as chunks in local coordinates: itself, or the chunks ZeRO already made of it."""
    chunks = getattr(tensor, "_chunks", None)
    if chunks is not None:
        return [(torch.Size(o), t) for o, t in chunks]
    return [(torch.Size([0] * tensor.dim()), tensor)]


def full_chunks(chunks: list[Chunk], layout: ShardedLayout) -> list[Chunk]:
    """Chunks of the local tensor (local offsets) as chunks of the full tensor: each cut at the layout's box edges."""
    out = []
    for c_off, t in chunks:
        for f_off, l_off, size in layout.boxes():
            lo = [max(c, l) for c, l in zip(c_off, l_off)]
            hi = [min(c + n, l + s) for c, n, l, s in zip(c_off, t.shape, l_off, size)]
            if all(a < b for a, b in zip(lo, hi)):
                piece = narrow_box(t, tuple(a - c for a, c in zip(lo, c_off)), tuple(b - a for a, b in zip(lo, hi)))
                out.append((torch.Size(f + (a - l) for f, a, l in zip(f_off, lo, l_off)), piece))
    return out


def sharded_view(tensor: Any, layout: ShardedLayout | None) -> Any:
    """`tensor` as DCP should see it: a full-shape view if it is this rank's part (or ZeRO's chunks of it)."""
    if layout is None or not torch.is_tensor(tensor) or tuple(tensor.shape) != layout.local_shape:
        return tensor
    return ChunkedTensor(layout.full_shape, full_chunks(local_chunks(tensor), layout), dtype=tensor.dtype, device=tensor.device)


def checkpoint_views(state: dict[str, Any], layouts: Mapping[str, ShardedLayout]) -> dict[str, Any]:
    """Engine state (`{"model": {name: t}, "optim": {name: {key: t}}}`) with the tensors of the parameters `layouts`
    names as full-shape views; everything else as it is."""

    def wrap(name: str, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: wrap(name, v) for k, v in value.items()}
        return sharded_view(value, layouts.get(name))

    return {section: {name: wrap(name, v) for name, v in part.items()} if isinstance(part, dict) else part for section, part in state.items()}
