"""Thin helpers over c10d: bucket planning, async collectives, and a meter that counts traffic.

Every collective behemoth issues goes through here so that the volume each rank sends (elements,
bytes) and the time spent waiting are counted for the profiler and for the ZeRO volume checks.
"""

from __future__ import annotations

import datetime
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist


@dataclass
class OpStats:
    calls: int = 0
    elements: int = 0
    bytes: int = 0
    wait_s: float = 0.0


@dataclass
class CommMeter:
    """Per-operation counters of what this rank handed to collectives."""

    ops: dict[str, OpStats] = field(default_factory=lambda: defaultdict(OpStats))

    def record(self, op: str, tensor: torch.Tensor) -> None:
        s = self.ops[op]
        s.calls += 1
        s.elements += tensor.numel()
        s.bytes += tensor.numel() * tensor.element_size()

    def add_wait(self, op: str, seconds: float) -> None:
        self.ops[op].wait_s += seconds

    def reset(self) -> None:
        self.ops.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        return {op: vars(s).copy() for op, s in self.ops.items()}


class Pending:
    """An in-flight collective; `wait` blocks until it is done and books the wait time."""

    def __init__(self, work: dist.Work | None, op: str, meter: CommMeter | None) -> None:
        self.work, self.op, self.meter = work, op, meter

    def done(self) -> bool:
        """True once the operation has completed; never blocks."""
        return self.work is None or self.work.is_completed()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until done; with `timeout_s`, raise RuntimeError (from c10d) if it takes longer."""
        if self.work is None:
            return
        t0 = time.perf_counter()
        if timeout_s is None:
            self.work.wait()
        else:
            self.work.wait(datetime.timedelta(seconds=timeout_s))
        if self.meter is not None:
            self.meter.add_wait(self.op, time.perf_counter() - t0)
        self.work = None


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, meter: CommMeter | None = None, *, async_op: bool = False) -> Pending:
    """Sum `tensor` in place over `group`."""
    if meter is not None:
        meter.record("all_reduce", tensor)
    pending = Pending(dist.all_reduce(tensor, group=group, async_op=True), "all_reduce", meter)
    if not async_op:
        pending.wait()
    return pending


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, meter: CommMeter | None = None, *, async_op: bool = False) -> Pending:
    """Sum `input` (world x shard) over `group`; this rank's shard lands in `output`."""
    if meter is not None:
        meter.record("reduce_scatter", input)
    pending = Pending(dist.reduce_scatter_single(output, input, group=group, async_op=True), "reduce_scatter", meter)
    if not async_op:
        pending.wait()
    return pending


def all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, meter: CommMeter | None = None, *, async_op: bool = False) -> Pending:
    """Concatenate every rank's `input` into `output` (world x shard)."""
    if meter is not None:
        meter.record("all_gather", output)
    pending = Pending(dist.all_gather_single(output, input, group=group, async_op=True), "all_gather", meter)
    if not async_op:
        pending.wait()
    return pending


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


def isend(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup, meter: CommMeter | None = None, *, tag: int = 0) -> Pending:
    """Start sending `tensor` to `peer` (a rank of `group`); keep `tensor` unchanged until the send is done."""
    if meter is not None:
        meter.record("send", tensor)
    return Pending(dist.isend(tensor, dist.get_global_rank(group, peer), group=group, tag=tag), "send", meter)


def irecv(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup, meter: CommMeter | None = None, *, tag: int = 0) -> Pending:
    """Start receiving into `tensor` from `peer` (a rank of `group`); the data is there once `wait` returns."""
    if meter is not None:
        meter.record("recv", tensor)
    return Pending(dist.irecv(tensor, dist.get_global_rank(group, peer), group=group, tag=tag), "recv", meter)


def pair_all_reduce(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup, meter: CommMeter | None = None, *,
                    tag: int = 0, timeout_s: float | None = None) -> None:
    """Sum `tensor` in place with its copy on `peer` (one exchange; both ranks get bitwise equal sums)."""
    theirs = torch.empty_like(tensor)
    recv = irecv(theirs, peer, group, meter, tag=tag)
    send = isend(tensor, peer, group, meter, tag=tag)
    recv.wait(timeout_s)
    send.wait(timeout_s)
    tensor.add_(theirs)
