"""The collectives of expert parallelism, as autograd functions.

    all_to_all          forward: rows to the ranks of their experts   backward: the gradients back (the reverse all-to-all)
    all_to_all_start    the same, issued asynchronously: `finish` waits for it, so expert compute on earlier chunks
                        overlaps the transfer (its backward is synchronous)
    gather_experts      forward: all-gather every rank's experts       backward: reduce-scatter (sum) their gradients

Everything goes through `behemoth.comm`, so the run's CommMeter counts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from behemoth.comm import CommMeter, Pending, all_gather, all_to_all as comm_all_to_all, reduce_scatter


@dataclass(frozen=True)
class EPComm:
    """The expert-parallel group, this rank's place in it, the meter, and the longest wait on another rank."""

    group: dist.ProcessGroup
    size: int
    rank: int
    meter: CommMeter | None = None
    timeout_s: float | None = None

    @classmethod
    def of(cls, group: dist.ProcessGroup, meter: CommMeter | None = None, timeout_s: float | None = None) -> "EPComm":
        return cls(group, dist.get_world_size(group), dist.get_rank(group), meter, timeout_s)


def _exchange(x: torch.Tensor, ep: EPComm, send: list[int], recv: list[int], *, async_op: bool = False) -> tuple[torch.Tensor, Pending]:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    pending = comm_all_to_all(out, x.contiguous(), ep.group, ep.meter, output_splits=recv, input_splits=send, async_op=async_op)
    return out, pending


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ep: EPComm, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.ep, ctx.send, ctx.recv = ep, send, recv
        return _exchange(x, ep, send, recv)[0]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _exchange(grad, ctx.ep, ctx.recv, ctx.send)[0], None, None, None


def all_to_all(x: torch.Tensor, ep: EPComm, send: list[int], recv: list[int]) -> torch.Tensor:
    """Send `send[j]` consecutive rows to rank j; receive `recv[j]` rows from rank j, in rank order."""
    return _AllToAll.apply(x, ep, send, recv)


@dataclass
class InFlight:
    """An all-to-all issued but not yet waited for."""

    pending: Pending | None = None
    timeout_s: float | None = None
    done: bool = field(default=False)


class _AllToAllStart(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ep: EPComm, send: list[int], recv: list[int], flight: InFlight) -> torch.Tensor:
        ctx.ep, ctx.send, ctx.recv = ep, send, recv
        out, flight.pending = _exchange(x, ep, send, recv, async_op=True)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return _exchange(grad, ctx.ep, ctx.recv, ctx.send)[0], None, None, None, None


class _Finish(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, flight: InFlight) -> torch.Tensor:
        if flight.pending is not None:
            flight.pending.wait(flight.timeout_s)
            flight.pending = None
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad, None


def all_to_all_start(x: torch.Tensor, ep: EPComm, send: list[int], recv: list[int]) -> tuple[torch.Tensor, InFlight]:
    """`all_to_all`, issued asynchronously: the rows must not be read before `finish` returns them."""
    flight = InFlight(timeout_s=ep.timeout_s)
    return _AllToAllStart.apply(x, ep, send, recv, flight), flight


def finish(out: torch.Tensor, flight: InFlight) -> torch.Tensor:
    """The received rows of an `all_to_all_start`, once they have arrived."""
    return _Finish.apply(out, flight)


class _GatherExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, ep: EPComm) -> torch.Tensor:
        ctx.ep = ep
        full = local.new_empty((ep.size * local.shape[0], *local.shape[1:]))
        all_gather(full, local.contiguous(), ep.group, ep.meter)
        return full

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        ep = ctx.ep
        local = grad.new_empty((grad.shape[0] // ep.size, *grad.shape[1:]))
        reduce_scatter(local, grad.contiguous(), ep.group, ep.meter)
        return local, None


def gather_experts(local: torch.Tensor, ep: EPComm) -> torch.Tensor:
    """Every rank's experts of a stacked weight, in expert order (rank j holds the j-th block of E / ep)."""
    return _GatherExperts.apply(local, ep) if ep.size > 1 else local
