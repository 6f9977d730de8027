"""3-D tensor parallelism (Bian et al., 2021; Colossal-AI's `3d`): a tensor-parallel group of q x q x q ranks as a cube,
and the all-gather / reduce-scatter product over it.

Rank (t, a, b) sits at t along the cube's T axis, a along A and b along B (tp-group rank t*q^2 + a*q + b). A linear
layer Y = X W names an input axis I and an output axis O (A and B, in either order; T is always the third):
    X  [tokens, in]    tokens: T's block t, cut in q by the rank's O coordinate; features: I's block      1/q^3
    W  [in, out]       in: I's block, cut in q by t; out: O's block (stored as nn.Linear's [out, in])      1/q^3
    Y  [tokens, out]   tokens: T's block t, cut in q by the rank's I coordinate; features: O's block      1/q^3
Forward: all-gather X along O (T's whole token block t), all-gather W along T (block (I, O)), multiply, and
reduce-scatter the partial Y along I (the sum over I's input blocks, each rank keeping its I coordinate's tokens).
Backward is the conjugate: all-gather dY along I; dX = dY W^T reduce-scattered along O; dW = X^T dY reduce-scattered
along T (summing T's token blocks). Y's layout is X's with A and B swapped, so a layer A -> B followed by one B -> A
(attention's qkv and proj, the MLP's fc and proj) returns to the residual stream's layout: features on A, tokens cut
by B.

Per rank and linear layer, with x = tokens * h_in / q^3, w = h_in * h_out / q^3 and y = tokens * h_out / q^3
elements, the counted volume (an all-gather counts its output, a reduce-scatter its input: q times the piece) is
forward q (x + w + y), backward q (y + x + w): 2 q (x + w + y) (`cube_volume`). Each ring moves (q-1)/q of it:
2 (q-1) (X + W + Y) / q^3 of the full tensors (`ring_volume`, the published 6 (q-1)/q^3 when the three are equal).
The linear saves its gathered input and weight (q x + q w) for the backward, as Colossal-AI's does; with `regather`
(parallel.tp_regather=true) it saves its pieces (x + w) and gathers them again in backward: q (x + w) more elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from behemoth.comm import CommMeter, all_gather, reduce_scatter
from behemoth.errors import BehemothError
from behemoth.models import gemm
from behemoth.parallel.tensor.comm import TPComm

AXES = ("t", "a", "b")


@dataclass(frozen=True)
class Grid3D:
    """This rank's place (t, a, b) in a q x q x q cube, its groups along each axis and over the two planes that hold
    one A or one B block (`planes["a"]`: the q^2 ranks at this a, indexed t*q + b), and the meter. Groups may be None
    for planning (shapes only)."""

    q: int
    coords: tuple[int, int, int]  # (t, a, b)
    lines: dict[str, Any]  # axis -> dist.ProcessGroup of the q ranks differing only there (indexed by that coordinate)
    planes: dict[str, Any]  # "a" | "b" -> the q^2 ranks at this rank's a (resp. b), indexed t*q + (b resp. a)
    meter: CommMeter | None = None
    regather: bool = False  # linears save their input and weight pieces and gather them again in backward

    @classmethod
    def build(cls, tp_groups: list[list[int]], rank: int, meter: CommMeter | None = None, regather: bool = False) -> Grid3D:
        """The cubes of every tp group (global ranks in tp order). Every rank creates every group in the same order."""
        q = round(len(tp_groups[0]) ** (1 / 3))
        at = lambda g, t, a, b: g[t * q * q + a * q + b]  # noqa: E731
        mine = None
        for g in tp_groups:
            idx = range(q)
            lines = {
                "t": {(a, b): dist.new_group([at(g, t, a, b) for t in idx]) for a in idx for b in idx},
                "a": {(t, b): dist.new_group([at(g, t, a, b) for a in idx]) for t in idx for b in idx},
                "b": {(t, a): dist.new_group([at(g, t, a, b) for b in idx]) for t in idx for a in idx},
            }
            planes = {
                "a": {a: dist.new_group([at(g, t, a, b) for t in idx for b in idx]) for a in idx},
                "b": {b: dist.new_group([at(g, t, a, b) for t in idx for a in idx]) for b in idx},
            }
            if rank in g:
                t, rest = divmod(g.index(rank), q * q)
                a, b = divmod(rest, q)
                line = {"t": lines["t"][a, b], "a": lines["a"][t, b], "b": lines["b"][t, a]}
                mine = cls(q, (t, a, b), line, {"a": planes["a"][a], "b": planes["b"][b]}, meter, regather)
        if mine is None:
            raise BehemothError(f"rank {rank} is in no tensor-parallel group", "build the cube from the mesh's tp groups")
        return mine

    @classmethod
    def shape_only(cls, q: int, rank: int) -> Grid3D:
        t, rest = divmod(rank, q * q)
        return cls(q, (t, *divmod(rest, q)), {}, {})

    def coord(self, axis: str) -> int:
        return self.coords[AXES.index(axis)]

    def plane_index(self, axis: str) -> int:
        """This rank's index in the plane at its `axis` coordinate: t*q + the other of a and b."""
        return self.coords[0] * self.q + self.coord(other(axis))

    def batch_index(self, feature_axis: str) -> int:
        """Which of the micro-batch's q^2 sequence blocks an activation with features on `feature_axis` holds."""
        return self.coords[0] * self.q + self.coord(other(feature_axis))

    def line_comm(self, axis: str) -> TPComm:
        return TPComm(self.lines[axis], self.q, self.coord(axis), self.meter)

    def plane_comm(self, axis: str) -> TPComm:
        return TPComm(self.planes[axis], self.q * self.q, self.plane_index(axis), self.meter)


def other(axis: str) -> str:
    """A <-> B: the axis an activation's tokens are cut by when its features are on `axis`."""
    return "b" if axis == "a" else "a"


def cube_volume(tokens: int, h_in: int, h_out: int, q: int, regather: bool = False) -> int:
    """Elements one rank hands to collectives in one linear layer's forward and backward (module docstring); with
    `regather`, the input and weight gathered again in backward: q (x + w) more."""
    again = q * (tokens * h_in + h_in * h_out) // q**3 if regather else 0
    return 2 * q * (tokens * h_in + h_in * h_out + tokens * h_out) // q**3 + again


def ring_volume(tokens: int, h_in: int, h_out: int, q: int) -> float:
    """Bian et al.'s bandwidth term (Colossal-AI's docs: 6 (q-1)/q^3): each of the six collectives moves (q-1)/q^3 of its
    full tensor (X, W, Y forward; dY, dX, dW backward) through a ring, per rank."""
    return 2 * (q - 1) * (tokens * h_in + h_in * h_out + tokens * h_out) / q**3


def cube_side(tp: int) -> int:
    """q with q^3 == tp, or 0 when tp is no cube."""
    q = round(tp ** (1 / 3))
    return q if q**3 == tp else 0


def _gather0(t: torch.Tensor, group: Any, q: int, meter: CommMeter | None) -> torch.Tensor:
    t = t.contiguous()
    out = t.new_empty((q * t.shape[0], *t.shape[1:]))
    all_gather(out, t, group, meter)
    return out


def _scatter0(t: torch.Tensor, group: Any, q: int, meter: CommMeter | None) -> torch.Tensor:
    t = t.contiguous()
    out = t.new_empty((t.shape[0] // q, *t.shape[1:]))
    reduce_scatter(out, t, group, meter)
    return out


def _gather_operands(x: torch.Tensor, weight: torch.Tensor, grid: Grid3D, o_axis: str) -> tuple[torch.Tensor, torch.Tensor]:
    """X gathered along O ([tokens/q, in_I]: T's whole block) and W along T ([in_I, out_O]: block (I, O) transposed)."""
    return _gather0(x, grid.lines[o_axis], grid.q, grid.meter), _gather0(weight.t(), grid.lines["t"], grid.q, grid.meter)


class _Cube(torch.autograd.Function):
    """Y = X W^T for a nn.Linear piece W [out_O, in_I / q] on the cube (module docstring); x is [tokens/q^2, in_I]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, spec: tuple[Grid3D, str, str]) -> torch.Tensor:
        grid, i_axis, o_axis = spec
        q, meter = grid.q, grid.meter
        full_x, w_t = _gather_operands(x, weight.detach(), grid, o_axis)
        ctx.save_for_backward(*((x, weight.detach()) if grid.regather else (full_x, w_t)))
        ctx.spec, ctx.dtypes = spec, (x.dtype, weight.dtype)
        return _scatter0(gemm.matmul(full_x, w_t.to(full_x.dtype)), grid.lines[i_axis], q, meter)  # train.gemm's library

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grid, i_axis, o_axis = ctx.spec
        q, meter = grid.q, grid.meter
        saved_x, saved_w = ctx.saved_tensors
        full_x, w_t = _gather_operands(saved_x, saved_w, grid, o_axis) if grid.regather else (saved_x, saved_w)
        full_grad = _gather0(grad, grid.lines[i_axis], q, meter)  # [tokens/q, out_O]
        grad_x = _scatter0(gemm.matmul(full_grad, w_t.t().to(full_grad.dtype)), grid.lines[o_axis], q, meter)
        grad_w = _scatter0(gemm.mm(full_x.t().to(full_grad.dtype), full_grad), grid.lines["t"], q, meter)  # [in_I/q, out_O]
        return grad_x.to(ctx.dtypes[0]), grad_w.t().to(ctx.dtypes[1]), None


def cube_linear(x: torch.Tensor, weight: torch.Tensor, grid: Grid3D, i_axis: str, o_axis: str) -> torch.Tensor:
    """X [tokens/q^2, in/q] (features on `i_axis`) times the cube's weight: Y [tokens/q^2, out/q] (features on `o_axis`)."""
    return _Cube.apply(x, weight, (grid, i_axis, o_axis))


class _GatherPlane(torch.autograd.Function):
    """A vector's 1/q^3 piece, along the last dimension: all-gathered over the plane that holds its block forward,
    reduce-scattered backward (the gradient summed over the plane's q^2 token blocks)."""

    @staticmethod
    def forward(ctx, piece: torch.Tensor, comm: TPComm) -> torch.Tensor:
        ctx.comm = comm
        return _gather0(piece.detach().movedim(-1, 0), comm.group, comm.size, comm.meter).movedim(0, -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm: TPComm = ctx.comm
        return _scatter0(grad.movedim(-1, 0), comm.group, comm.size, comm.meter).movedim(0, -1), None


def gather_plane(piece: torch.Tensor, grid: Grid3D, axis: str) -> torch.Tensor:
    """The `axis` block of a vector (or of a table's features) from this rank's 1/q^3 piece of it."""
    return _GatherPlane.apply(piece, grid.plane_comm(axis))


def cube_of(mesh_ranks: torch.Tensor, tp_dim: int, meter: CommMeter, regather: bool = False) -> Grid3D:
    """This rank's cube from the mesh's global ranks (every tp group's, in tp order)."""
    tp = mesh_ranks.shape[tp_dim]
    groups = mesh_ranks.movedim(tp_dim, -1).reshape(-1, tp).tolist()
    if not cube_side(tp) or math.prod(mesh_ranks.shape) != dist.get_world_size():
        raise BehemothError(f"parallel.tp={tp} is no cube q*q*q", "use parallel.tp=8 (2 x 2 x 2) or 27")
    return Grid3D.build(groups, dist.get_rank(), meter, regather)
