"""Checkpoint views of tensor-parallel tensors: full-tensor semantics for DCP, no copies.

A split parameter is saved under its single-process name and full shape; each rank writes its pieces
(a fused [q|k|v] weight has three, padding rows none) at their offsets in the full tensor. DCP then
reshards on load — into another tp degree, or into one process for `behemoth export`. DTensor cannot say
"three pieces per rank" (a `_StridedShard` is written by DCP as one box), so the view is a
`ChunkedTensor`, which implements DCP's checkpointable protocol itself.

A tensor that ZeRO already describes as chunks of the tp-local parameter (anything with `_chunks`: a
list of (offsets, view) in local coordinates) is translated into full-tensor coordinates the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from behemoth.parallel.chunked import ChunkedTensor
from behemoth.parallel.tensor.layers import ShardLayout

Chunk = tuple[torch.Size, torch.Tensor]  # offsets in the full tensor, a view of this rank's storage


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
    return ChunkedTensor(layout.full_shape, to_full_chunks(local_chunks(tensor), layout), dtype=tensor.dtype, device=tensor.device)
