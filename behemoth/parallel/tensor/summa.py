"""2-D tensor parallelism (Optimus; Colossal-AI's `2d`): a tensor-parallel group of q x q ranks as a grid, and
SUMMA's products over it.

Rank (i, j) of the grid holds block (i, j) of every activation and block (i, j) of every weight:
    activation X [tokens, h]       tokens split by grid row i (whole sequences: the batch), features by column j
    weight     W [h_in, h_out]     inputs split by row i, outputs by column j (stored as nn.Linear's [out, in])
    vector     b [h] (bias, norm)  column j's block of h, itself cut in q pieces by row i: 1/q^2 of it per rank
Y = X W is Y_ij = sum_k X_ik W_kj, made in q steps: at step k, rank (i, k) broadcasts X_ik along row i and rank (k, j)
broadcasts W_kj along column j, and each rank adds X_ik W_kj (SUMMA). Backward runs the same grid twice over:
dX_ik = sum_j dY_ij W_kj^T (W_kj broadcast along columns, the partial products reduced along rows to (i, k)) and
dW_kj = sum_i X_ik^T dY_ij (X_ik broadcast along rows, the partial products reduced along columns to (k, j)).

Per rank and per linear layer, with x = |X_ij| = tokens * h_in / q^2 and w = |W_ij| = h_in * h_out / q^2 elements,
the counted volume is forward q (x + w) broadcast, backward q (x + w) broadcast + q (x + w) reduced: 3 q (x + w)
(`summa_volume`). A vector's pieces are all-gathered along the column (reduce-scattered back in backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from behemoth.comm import CommMeter, all_gather, broadcast, reduce, reduce_scatter
from behemoth.errors import BehemothError
from behemoth.models import gemm
from behemoth.parallel.chunked import Box, narrow_box
from behemoth.parallel.tensor.comm import TPComm

Pieces = tuple[tuple[int, int, int], ...]  # along one dimension: (full start, local start, length)


@dataclass(frozen=True)
class Grid2D:
    """This rank's place (row, col) in a q x q tensor-parallel grid, the groups along its row (indexed by column) and
    its column (indexed by row), and the meter their traffic goes to. Groups may be None for planning (shapes only).

    2.5-D (Tesseract): `depth` d such grids, one per layer; each holds the same weight blocks and its own 1/d of the
    batch (`layer`), and the layers' weight gradients are summed over `depth_group` (the ranks at (row, col) of every
    layer) once per step."""

    q: int
    row: int
    col: int
    row_group: Any  # dist.ProcessGroup of ranks (row, 0..q-1)
    col_group: Any  # dist.ProcessGroup of ranks (0..q-1, col)
    meter: CommMeter | None = None
    depth: int = 1
    layer: int = 0
    depth_group: Any = None  # dist.ProcessGroup of ranks (row, col) of layers 0..d-1 (depth > 1)
    shared_batch: bool = False  # inference: every row runs the whole batch (a request's KV stays on its column's ranks)

    @classmethod
    def build(cls, tp_groups: list[list[int]], rank: int, meter: CommMeter | None = None, depth: int = 1, shared_batch: bool = False) -> Grid2D:
        """The grids of every tp group (global ranks, in tp order: rank l*q*q + i*q + j is (i, j) of layer l). Every rank
        of the world creates every row, column and depth group, in the same order (c10d's rule for new_group)."""
        q = math.isqrt(len(tp_groups[0]) // depth)
        layers = [g[n * q * q : (n + 1) * q * q] for g in tp_groups for n in range(depth)]
        row_groups = [dist.new_group(g[i * q : (i + 1) * q]) for g in layers for i in range(q)]
        col_groups = [dist.new_group(g[j::q]) for g in layers for j in range(q)]
        depth_groups = [dist.new_group(g[m :: q * q]) for g in tp_groups for m in range(q * q)] if depth > 1 else []
        for n, g in enumerate(layers):
            if rank in g:
                i, j = divmod(g.index(rank), q)
                tp_index = n // depth
                deep = depth_groups[tp_index * q * q + i * q + j] if depth > 1 else None
                return cls(q, i, j, row_groups[n * q + i], col_groups[n * q + j], meter, depth, n % depth, deep, shared_batch)
        raise BehemothError(f"rank {rank} is in no tensor-parallel group", "build the grid from the mesh's tp groups")

    @property
    def batch_blocks(self) -> int:
        """How many parts a micro-batch's sequences are cut into: q rows of each of the d layers (1: `shared_batch`)."""
        return 1 if self.shared_batch else self.depth * self.q

    @property
    def batch_index(self) -> int:
        return 0 if self.shared_batch else self.layer * self.q + self.row

    def row_comm(self) -> TPComm:
        """The row as a TPComm (the vocabulary-parallel loss over column j's vocabulary block)."""
        return TPComm(self.row_group, self.q, self.col, self.meter)

    def col_comm(self) -> TPComm:
        return TPComm(self.col_group, self.q, self.row, self.meter)

    def depth_comm(self) -> TPComm | None:
        return TPComm(self.depth_group, self.depth, self.layer, self.meter) if self.depth > 1 else None


def summa_volume(tokens: int, h_in: int, h_out: int, q: int) -> int:
    """Elements one rank hands to collectives in one linear layer's forward and backward (module docstring)."""
    return 3 * q * (tokens * h_in // q**2 + h_in * h_out // q**2)


# ---- layouts: which block of a full tensor a rank holds, as DCP boxes (parallel/chunked.py) ----


def even(n: int, parts: int, index: int, name: str) -> Pieces:
    """Part `index` of `parts` equal parts of [0, n)."""
    if n % parts:
        raise BehemothError(f"{name}: size {n} does not split into {parts} equal parts (2-D tensor parallelism)", f"choose a tp whose q divides {n}")
    return ((index * (n // parts), 0, n // parts),)


def packed(n: int, segments: int, parts: int, index: int, name: str) -> Pieces:
    """Part `index` of each of `segments` fused equal segments of [0, n) (a fused [q|k|v]: whole heads of each)."""
    seg = n // segments
    chunk = even(seg, parts, index, name)[0][2]
    return tuple((s * seg + index * chunk, s * chunk, chunk) for s in range(segments))


def sub(pieces: Pieces, parts: int, index: int, name: str) -> Pieces:
    """Part `index` of `parts` equal parts of what `pieces` hold (in their local order), re-based to start at 0."""
    total = sum(length for _, _, length in pieces)
    ((start, _, length),) = even(total, parts, index, name)
    out, at = [], 0
    for full, local, size in pieces:
        lo, hi = max(local, start), min(local + size, start + length)
        if lo < hi:
            out.append((full + lo - local, at, hi - lo))
            at += hi - lo
    return tuple(out)


@dataclass(frozen=True)
class BlockLayout:
    """This rank's block of a full tensor: pieces along every dimension (whole dimensions are one piece)."""

    full_shape: tuple[int, ...]
    dims: tuple[Pieces, ...]

    @classmethod
    def of(cls, full_shape: tuple[int, ...], **split: Pieces) -> BlockLayout:
        """`split` names dimensions by `d0`, `d1`, ...; the others are whole."""
        return cls(tuple(full_shape), tuple(split.get(f"d{d}", ((0, 0, n),)) for d, n in enumerate(full_shape)))

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(sum(length for _, _, length in pieces) for pieces in self.dims)

    def boxes(self) -> list[Box]:
        out: list[Box] = [((), (), ())]
        for pieces in self.dims:
            out = [(f + (start,), lo + (local,), s + (length,)) for f, lo, s in out for start, local, length in pieces]
        return out

    def take_local(self, full: torch.Tensor) -> torch.Tensor:
        out = full.new_empty(self.local_shape)
        for f, lo, size in self.boxes():
            narrow_box(out, lo, size).copy_(narrow_box(full, f, size))
        return out


# ---- the collectives of the grid, as autograd functions ----


def _broadcast_block(t: torch.Tensor, src: int, mine: bool, group: Any, meter: CommMeter | None) -> torch.Tensor:
    """The block rank `src` of `group` holds: `t` itself there, a received copy elsewhere (`t` gives the shape)."""
    block = t if mine else torch.empty_like(t)
    broadcast(block, src, group, meter)
    return block


class _Summa(torch.autograd.Function):
    """Y_ij = sum_k X_ik W_kj^T for nn.Linear blocks W [out_j, in_k] (module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, grid: Grid2D) -> torch.Tensor:
        x = x.contiguous()
        ctx.save_for_backward(x, weight)
        ctx.grid = grid
        out = None
        for k in range(grid.q):
            a = _broadcast_block(x, k, grid.col == k, grid.row_group, grid.meter)
            w = _broadcast_block(weight.detach(), k, grid.row == k, grid.col_group, grid.meter)
            part = gemm.matmul(a, w.t().to(a.dtype))  # by train.gemm's library
            out = part if out is None else out + part
        assert out is not None  # q >= 1 steps
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grid: Grid2D = ctx.grid
        grad = grad.contiguous()
        grad_x = grad_w = None
        for k in range(grid.q):
            w = _broadcast_block(weight.detach(), k, grid.row == k, grid.col_group, grid.meter)
            part_x = gemm.matmul(grad, w.to(grad.dtype)).contiguous()  # this rank's share of dX_ik
            reduce(part_x, k, grid.row_group, grid.meter)
            if grid.col == k:
                grad_x = part_x.to(x.dtype)
            a = _broadcast_block(x, k, grid.col == k, grid.row_group, grid.meter)
            part_w = gemm.mm(grad.t(), a.to(grad.dtype)).contiguous()  # this rank's share of dW_kj
            reduce(part_w, k, grid.col_group, grid.meter)
            if grid.row == k:
                grad_w = part_w.to(weight.dtype)
        return grad_x, grad_w, None


def summa_linear(x: torch.Tensor, weight: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """X_ij [tokens/q, in/q] times the grid's weight (nn.Linear blocks [out/q, in/q]): Y_ij [tokens/q, out/q]."""
    return _Summa.apply(x, weight, grid)


class _GatherColumn(torch.autograd.Function):
    """A piece of a column's block, along the last dimension: all-gathered along the column forward (the block),
    reduce-scattered backward (the gradient summed over the column's rows, which hold different tokens)."""

    @staticmethod
    def forward(ctx, piece: torch.Tensor, grid: Grid2D) -> torch.Tensor:
        ctx.grid = grid
        flat = piece.detach().movedim(-1, 0).contiguous()  # [n/q^2, ...]
        out = flat.new_empty((grid.q * flat.shape[0], *flat.shape[1:]))
        all_gather(out, flat, grid.col_group, grid.meter)
        return out.movedim(0, -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grid: Grid2D = ctx.grid
        flat = grad.movedim(-1, 0).contiguous()
        out = flat.new_empty((flat.shape[0] // grid.q, *flat.shape[1:]))
        reduce_scatter(out, flat, grid.col_group, grid.meter)
        return out.movedim(0, -1), None


def gather_column(piece: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """Column j's block of a vector (or of an embedding table's features) from this rank's 1/q^2 piece of it."""
    return _GatherColumn.apply(piece, grid)
