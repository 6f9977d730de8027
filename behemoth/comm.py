"""Thin helpers over c10d: bucket planning, async collectives, and a meter that counts traffic.

Every collective behemoth issues goes through here so that the volume each rank sends (elements,
bytes) is counted for the profiler and for the ZeRO volume checks, and so that each one is in the
flight recorder (`behemoth.flight`): a wait that fails or times out raises a `HangError` naming the
operation, the group and the rank(s) it waited for, instead of c10d's raw text.
"""

from __future__ import annotations

import contextlib
import datetime
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from behemoth.flight import RECORDER, OpRecord


@dataclass
class OpStats:
    calls: int = 0
    elements: int = 0
    bytes: int = 0


@dataclass
class CommMeter:
    """Per-operation counters of what this rank handed to collectives."""

    ops: dict[str, OpStats] = field(default_factory=lambda: defaultdict(OpStats))

    def record(self, op: str, tensor: torch.Tensor) -> None:
        s = self.ops[op]
        s.calls += 1
        s.elements += tensor.numel()
        s.bytes += tensor.numel() * tensor.element_size()

    def record_elements(self, op: str, elements: int, element_size: int) -> None:
        """Count `elements` of `element_size` bytes under `op` (a collective whose traffic is not one whole tensor)."""
        s = self.ops[op]
        s.calls += 1
        s.elements += elements
        s.bytes += elements * element_size

    def reset(self) -> None:
        self.ops.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        return {op: vars(s).copy() for op, s in self.ops.items()}


class Pending:
    """An in-flight collective or transfer; `wait` blocks until it is done."""

    def __init__(self, work: dist.Work | None, record: OpRecord | None = None) -> None:
        self.work, self.record = work, record

    def done(self) -> bool:
        """True once the operation has completed; never blocks."""
        finished = self.work is None or self.work.is_completed()
        if finished and self.record is not None:
            RECORDER.end(self.record)
        return finished

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until done; if it fails or takes longer than `timeout_s` (default: the group's timeout), raise
        HangError naming the operation and the ranks it waited for (RuntimeError from c10d for an unrecorded one)."""
        if self.work is None:
            return
        try:
            if timeout_s is None:
                self.work.wait()
            else:
                self.work.wait(datetime.timedelta(seconds=timeout_s))
        except RuntimeError as err:
            if self.record is None:
                raise
            raise RECORDER.failure(self.record, err, timeout_s) from None
        if self.record is not None:
            RECORDER.end(self.record)
        self.work = None


def issue(op: str, group: dist.ProcessGroup, tensor: torch.Tensor, start: Callable[[], dist.Work], *, async_op: bool) -> Pending:
    """Start one recorded collective (`start()` issues it asynchronously); wait for it unless `async_op`."""
    record = RECORDER.begin(op, group, nbytes=tensor.numel() * tensor.element_size())
    try:
        work = start()
    except RuntimeError as err:
        raise RECORDER.failure(record, err) from None
    RECORDER.attach(record, work)
    pending = Pending(work, record)
    if not async_op:
        pending.wait()
    return pending


@contextlib.contextmanager
def watched(op: str, group: dist.ProcessGroup) -> Iterator[OpRecord]:
    """Record a blocking collective run inside the block; its failure becomes a HangError."""
    record = RECORDER.begin(op, group)
    try:
        yield record
    except RuntimeError as err:
        raise RECORDER.failure(record, err) from None
    RECORDER.end(record)


def barrier(group: dist.ProcessGroup) -> None:
    """Every rank of `group` reaches this point (recorded like any collective)."""
    if dist.get_world_size(group) > 1:
        with watched("barrier", group):
            dist.barrier(group=group)


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    meter: CommMeter | None = None,
    *,
    async_op: bool = False,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> Pending:
    """Reduce `tensor` in place over `group`, summing unless `op` says otherwise (a group of one has nothing to add)."""
    if dist.get_world_size(group) == 1:
        return Pending(None)
    if meter is not None:
        meter.record("all_reduce", tensor)
    return issue("all_reduce", group, tensor, lambda: dist.all_reduce(tensor, op=op, group=group, async_op=True), async_op=async_op)


def reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, meter: CommMeter | None = None, *, async_op: bool = False
) -> Pending:
    """Sum `input` (world x shard) over `group`; this rank's shard lands in `output`."""
    if meter is not None:
        meter.record("reduce_scatter", input)
    return issue("reduce_scatter", group, input, lambda: dist.reduce_scatter_single(output, input, group=group, async_op=True), async_op=async_op)


def all_gather(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, meter: CommMeter | None = None, *, async_op: bool = False
) -> Pending:
    """Concatenate every rank's `input` into `output` (world x shard)."""
    if meter is not None:
        meter.record("all_gather", output)
    return issue("all_gather", group, output, lambda: dist.all_gather_single(output, input, group=group, async_op=True), async_op=async_op)


def broadcast(tensor: torch.Tensor, group_src: int, group: dist.ProcessGroup, meter: CommMeter | None = None) -> None:
    """Copy `tensor` from the group's rank `group_src` into every other rank's `tensor` (in place); each rank counts the
    block it sends or receives."""
    if dist.get_world_size(group) == 1:
        return
    if meter is not None:
        meter.record("broadcast", tensor)
    issue("broadcast", group, tensor, lambda: dist.broadcast(tensor, group=group, group_src=group_src, async_op=True), async_op=False)


def reduce(tensor: torch.Tensor, group_dst: int, group: dist.ProcessGroup, meter: CommMeter | None = None) -> None:
    """Sum every rank's `tensor` into the one on the group's rank `group_dst` (the others' are left undefined)."""
    if dist.get_world_size(group) == 1:
        return
    if meter is not None:
        meter.record("reduce", tensor)
    issue("reduce", group, tensor, lambda: dist.reduce(tensor, group=group, group_dst=group_dst, async_op=True), async_op=False)


def all_to_all(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup,
    meter: CommMeter | None = None,
    *,
    output_splits: list[int] | None = None,
    input_splits: list[int] | None = None,
    async_op: bool = False,
) -> Pending:
    """Rank r's `input` rows [sum(input_splits[:j]), + input_splits[j]) go to rank j, which receives them as its
    `output_splits[r]` rows from r (even splits when None). The meter counts what this rank sends to the other ranks."""
    world = dist.get_world_size(group)
    if world == 1:
        output.copy_(input)
        return Pending(None)
    if meter is not None:
        rows = input.shape[0]
        splits = input_splits or [rows // world] * world
        per_row = input.numel() // rows if rows else 0
        meter.record_elements("all_to_all", (rows - splits[dist.get_rank(group)]) * per_row, input.element_size())
    return issue(
        "all_to_all",
        group,
        input,
        lambda: dist.all_to_all_single(output, input, output_splits, input_splits, group=group, async_op=True),
        async_op=async_op,
    )


def broadcast_object(make: Callable[[], Any], group: dist.ProcessGroup, is_source: bool) -> Any:
    """`make()` run on the group's first rank only, its (picklable) result returned on every rank of the group."""
    box = [make() if is_source else None]
    with watched("broadcast_object", group):
        dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def gather_object(value: Any, group: dist.ProcessGroup) -> list[Any]:
    """Every rank's (picklable) `value`, in the group's rank order, on every rank of the group."""
    out: list[Any] = [None] * dist.get_world_size(group)
    with watched("all_gather_object", group):
        dist.all_gather_object(out, value, group=group)
    return out


@torch.no_grad()
def reduce_flat(tensors: list[torch.Tensor], reduce: Callable[[torch.Tensor], object]) -> int:
    """Reduce several tensors with one collective: concatenate them, `reduce` the flat copy in place, copy back.
    Returns the element count (0, and no collective, for an empty list)."""
    if not tensors:
        return 0
    flat = torch.cat([t.reshape(-1) for t in tensors])
    reduce(flat)
    torch._foreach_copy_(tensors, [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)])
    return flat.numel()


def plan_buckets(params: Iterable[torch.nn.Parameter], bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Group parameters, in the given order, into buckets of about `bucket_bytes`.

    Callers pass parameters in reverse registration order, which approximates the order in which
    backward produces their gradients, so early buckets fill first.
    """
    buckets: list[list[torch.nn.Parameter]] = []
    current: list[torch.nn.Parameter] = []
    size = 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class P2P:
    """One transfer of a batched group: send `tensor` to `peer`, or receive into it from `peer` (a rank of the group)."""

    send: bool
    tensor: torch.Tensor
    peer: int
    tag: int = 0


def batch_p2p(ops: list[P2P], group: dist.ProcessGroup, meter: CommMeter | None = None) -> list[Pending]:
    """Issue `ops` together as one `dist.batch_isend_irecv`; one Pending per op, in order.

    On NCCL the group is one ncclGroupStart/End on the group's communicator: its transfers run on one
    stream after every earlier group, and the group completes as one work, so each op's Pending waits
    for all of them. gloo runs each op on its own (tags match messages there; NCCL matches by order).
    Keep every tensor unchanged (a send) or unread (a receive) until its Pending is done.
    """
    if not ops:
        return []
    p2p, records = [], []
    for op in ops:
        if meter is not None:
            meter.record("send" if op.send else "recv", op.tensor)
        p2p.append(dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor, group=group, tag=op.tag, group_peer=op.peer))
        records.append(
            RECORDER.begin("send" if op.send else "recv", group, peer_in_group=op.peer, nbytes=op.tensor.numel() * op.tensor.element_size())
        )
    try:
        works = dist.batch_isend_irecv(p2p)
    except RuntimeError as err:
        raise RECORDER.failure(records[0], err) from None
    if len(works) != len(ops):  # coalesced into one work for the whole group (NCCL)
        works = [works[0]] * len(ops)
    for record, work in zip(records, works):
        RECORDER.attach(record, work)
    return [Pending(work, record) for work, record in zip(works, records)]


def pair_all_reduce(
    tensor: torch.Tensor, peer: int, group: dist.ProcessGroup, meter: CommMeter | None = None, *, tag: int = 0, timeout_s: float | None = None
) -> None:
    """Sum `tensor` in place with its copy on `peer` (one exchange; both ranks get bitwise equal sums).

    The send and the receive form one batched group, so NCCL's rendezvous cannot deadlock it (a lone
    receive queued before a lone send on both ranks would).
    """
    theirs = torch.empty_like(tensor)
    for pending in batch_p2p([P2P(True, tensor, peer, tag), P2P(False, theirs, peer, tag)], group, meter):
        pending.wait(timeout_s)
    tensor.add_(theirs)
