"""The collectives of expert parallelism, as autograd functions.

    all_to_all          forward: rows to the ranks of their experts   backward: the gradients back (the reverse all-to-all)
                        (in two levels, Tutel's 2DH, when the ep group spans nodes and the splits are even: within each
                        node, then between the ranks of one local index, so each rank sends one message per other node
                        instead of one per remote rank: N-1 instead of W-m; `parallel.expert_a2a` picks it)
    all_to_all_start    the same, issued asynchronously: `finish` waits for it, so expert compute on earlier chunks
                        overlaps the transfer (its backward is synchronous)
    gather_experts      forward: all-gather every rank's experts       backward: reduce-scatter (sum) their gradients
    gather_rows         all-gather uneven row blocks (inference only: no backward), each padded to the longest

Everything goes through `behemoth.comm`, so the run's CommMeter counts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from behemoth.comm import CommMeter, Pending, all_gather, reduce_scatter
from behemoth.comm import all_to_all as comm_all_to_all


@dataclass(frozen=True)
class TwoLevel:
    """An ep group of `nodes` x `local` ranks, node-major: the ranks of this rank's node, and those of its local index."""

    intra: dist.ProcessGroup  # the `local` ep ranks on this rank's node
    inter: dist.ProcessGroup  # the `nodes` ep ranks with this rank's local index, one per node
    nodes: int
    local: int


@dataclass(frozen=True)
class EPComm:
    """The expert-parallel group, this rank's place in it, the meter, the longest wait on another rank, and the
    two-level split of the group when it spans several nodes."""

    group: dist.ProcessGroup
    size: int
    rank: int
    meter: CommMeter | None = None
    timeout_s: float | None = None
    levels: TwoLevel | None = None

    @classmethod
    def of(cls, group: dist.ProcessGroup, meter: CommMeter | None = None, timeout_s: float | None = None, levels: TwoLevel | None = None) -> EPComm:
        return cls(group, dist.get_world_size(group), dist.get_rank(group), meter, timeout_s, levels)


def two_level_groups(ep_groups: list[list[int]], node_size: int, me: int) -> TwoLevel | None:
    """This rank's two-level split of its ep group, given every ep group's global ranks and the ranks per node; None
    when no group spans several nodes with several of its ranks on each (node-major). Collective: every rank of the
    world calls it with the same groups, and every subgroup is created in the same order on all of them."""

    def shape(members: list[int]) -> tuple[int, int] | None:
        nodes = [r // node_size for r in members]
        local = nodes.count(nodes[0])
        ok = nodes == sorted(nodes) and all(nodes.count(n) == local for n in set(nodes))
        return (len(set(nodes)), local) if ok else None

    shapes = {shape(m) for m in ep_groups}
    if len(shapes) != 1 or None in shapes or min(next(iter(shapes))) < 2:
        return None
    nodes, local = next(iter(shapes))
    mine = None
    for members in ep_groups:
        grid = [members[n * local : (n + 1) * local] for n in range(nodes)]
        intra = [dist.new_group(row) for row in grid]
        inter = [dist.new_group([row[i] for row in grid]) for i in range(local)]
        if me in members:
            j = members.index(me)
            mine = TwoLevel(intra[j // local], inter[j % local], nodes, local)
    return mine


def two_level_all_to_all(x: torch.Tensor, ep: EPComm) -> torch.Tensor:
    """The all-to-all of equal row blocks [P, c, ...] (P = nodes x local, node-major) in two steps: within the node,
    each rank collects the blocks bound for its own local index on every node; between nodes, the ranks of one local
    index exchange them. The output is the one-level all-to-all's: row blocks by source rank."""
    lv = ep.levels
    block = x.reshape(lv.nodes, lv.local, -1, *x.shape[1:])  # [node, local, c, ...] by destination
    by_local = block.transpose(0, 1).contiguous()  # [dest local, dest node, c, ...]
    got = torch.empty_like(by_local)
    comm_all_to_all(got, by_local, lv.intra, ep.meter)  # [source local, dest node, c, ...]
    by_node = got.transpose(0, 1).contiguous()  # [dest node, source local, c, ...]
    out = torch.empty_like(by_node)
    comm_all_to_all(out, by_node, lv.inter, ep.meter)  # [source node, source local, c, ...]
    return out.reshape(x.shape[0], *x.shape[1:])


def inter_node_peers(ep: EPComm, node_size: int) -> int:
    """The ranks on other nodes this rank sends a message to in one all-to-all of even blocks, counted from the groups
    the exchange runs on: W - m for the flat one (every rank off this node), N - 1 for the two-level one (the rank of
    this local index on every other node; the intra-node step stays on the node)."""
    group = ep.group if ep.levels is None else ep.levels.inter
    me = dist.get_rank() // node_size
    return sum(r // node_size != me for r in dist.get_process_group_ranks(group))


def _exchange(x: torch.Tensor, ep: EPComm, send: list[int], recv: list[int], *, async_op: bool = False) -> tuple[torch.Tensor, Pending]:
    if ep.levels is not None and len(set(send)) == 1 and send == recv and x.shape[0]:
        return two_level_all_to_all(x.contiguous(), ep), Pending(None)
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


def gather_rows(x: torch.Tensor, ep: EPComm, rows: list[int]) -> torch.Tensor:
    """Every ep rank's block of rows (rank j's has `rows[j]`; this rank's is `x`), concatenated in rank order. For
    inference (no backward): each block goes padded to the longest, one all-gather."""
    width = max(rows)
    if width == 0:
        return x
    padded = x.new_zeros((width, *x.shape[1:]))
    padded[: x.shape[0]] = x
    out = x.new_empty((ep.size * width, *x.shape[1:]))
    all_gather(out, padded, ep.group, ep.meter)
    return torch.cat([out[j * width : j * width + n] for j, n in enumerate(rows)])
