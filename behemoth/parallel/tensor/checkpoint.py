"""Checkpoint views of tensor-parallel tensors: full-tensor semantics for DCP, no copies.

A split parameter is saved under its single-process name and full shape; each rank writes its pieces
(a fused [q|k|v] weight has three, padding rows none) at their offsets in the full tensor. DCP then
reshards on load — into another tp degree, or into one process for `behemoth export`. DTensor cannot say
"three pieces per rank" (a `_StridedShard` is written by DCP as one box), so the view implements DCP's
checkpointable protocol (`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`) itself.

A tensor that ZeRO already describes as chunks of the tp-local parameter (anything with `_chunks`: a
list of (offsets, view) in local coordinates) is translated into full-tensor coordinates the same way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from behemoth.parallel.tensor.layers import ShardLayout

Chunk = tuple[torch.Size, torch.Tensor]  # offsets in the full tensor, a view of this rank's storage


class ShardedView(torch.Tensor):
    """A tensor of the full shape whose only data are this rank's chunks; DCP reads and writes them."""

    _chunks: list[Chunk]

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], chunks: list[Chunk], *, dtype: torch.dtype, device: torch.device) -> "ShardedView":
        view = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=dtype, device=device, requires_grad=False)
        view._chunks = [(torch.Size(o), t) for o, t in chunks]
        return view

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten.detach.default:
            return args[0]
        raise NotImplementedError(f"{func} on a checkpoint view; it is only for torch.distributed.checkpoint")

    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return f"ShardedView(shape={tuple(self.shape)}, chunks={[(tuple(o), tuple(t.shape)) for o, t in self._chunks]})"

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, o), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(o, t.shape), properties=props, size=self.shape))
                for o, t in self._chunks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(o, t.shape) for o, t in self._chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for o, t in self._chunks:
            if o == index.offset:
                return t
        raise ValueError(f"{index.fqn}: this rank holds no chunk at offset {tuple(index.offset or ())}")


def local_chunks(tensor: torch.Tensor) -> list[Chunk]:
    """A tp-local tensor as chunks in local coordinates: itself, or the chunks ZeRO already made of it."""
    chunks = getattr(tensor, "_chunks", None)
    if chunks is not None:
        return [(torch.Size(o), t) for o, t in chunks]
    return [(torch.Size([0] * tensor.dim()), tensor)]


def to_full_chunks(chunks: list[Chunk], layout: ShardLayout) -> list[Chunk]:
    """Local chunks -> the same data's chunks in the full tensor (cut at piece edges, padding dropped)."""
    dim, out = layout.dim, []
    for offsets, t in chunks:
        lo, hi = offsets[dim], offsets[dim] + t.shape[dim]
        for start, local, length in layout.pieces:
            a, b = max(lo, local), min(hi, local + length)
            if a < b:
                full = list(offsets)
                full[dim] = start + (a - local)
                out.append((torch.Size(full), t.narrow(dim, a - lo, b - a)))
    return out


def sharded_view(tensor: Any, layout: ShardLayout | None) -> Any:
    """`tensor` as DCP should see it: a full-shape view if it is this rank's part of a split parameter."""
    if layout is None or not torch.is_tensor(tensor) or tuple(tensor.shape) != layout.local_shape:
        return tensor
    return ShardedView(layout.full_shape, to_full_chunks(local_chunks(tensor), layout), dtype=tensor.dtype, device=tensor.device)
