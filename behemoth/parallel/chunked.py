"""A tensor of which this rank holds some chunks, as DCP-readable and -writable N-D boxes.

Used wherever a rank's part of a parameter is not a DTensor `Shard(dim)` block: tensor parallelism's
fused [q|k|v] pieces and padded vocabularies (behemoth.parallel.tensor.checkpoint), and ZeRO's flat
ranges. ZeRO shards a parameter (or its Adam moments) by a contiguous range of its flattened elements,
which is generally not a DTensor `Shard(dim)` block. `ChunkedTensor` describes such a range as the
few N-D boxes DCP understands (`flat_range_boxes`), each a view of the rank's own storage,
so `dcp.save` writes straight from the shard and `dcp.load` writes straight into it, and a
checkpoint keyed by single-process names reshards to any other layout, stage or process count.
It implements DCP's checkpointable protocol (the three dunder methods DTensor also implements);
it is a description for checkpointing only and supports no other tensor operation.
"""

from __future__ import annotations

import math
from typing import Any

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
    def __new__(cls, shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], torch.Tensor]], *, dtype: torch.dtype, device: torch.device) -> "ChunkedTensor":
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
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, t.shape), properties=props, size=self.shape))
                for offsets, t in self._chunks]

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
        chunks.append((offsets, flat[pos:pos + n].view(sizes)))
        pos += n
    return ChunkedTensor(shape, chunks, dtype=flat.dtype, device=flat.device)
