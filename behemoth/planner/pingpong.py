"""The link timings of `behemoth calibrate`: each collective's curve by message size, on the whole world and on smaller
groups running at once (`LinkSpec.ops`, `LinkSpec.group_ops`), the ping-pong every p2p latency is measured by, what a
message waits for a core where the processes outnumber the cores (`HostSpec.wake_us`), and the CPU a process spends on
a message it sends or receives between computations (`HostSpec.message_cpu_us`)."""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from behemoth.comm import P2P, all_gather, all_reduce, all_to_all, barrier, batch_p2p, reduce_scatter
from behemoth.planner.cluster import COLLECTIVES, bus_factor


def core_count() -> int:
    """CPU cores this process may run on (the node's processes share them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def timed(fn: Any, reps: int, device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    """Median seconds of `fn()` over `reps` runs after one warm-up (every rank starts each run together)."""
    fn()
    times = []
    for _ in range(reps):
        if group is not None:
            barrier(group)
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def collective_curve(
    op: str, sizes: tuple[int, ...], device: torch.device, group: dist.ProcessGroup, start: dist.ProcessGroup | None = None
) -> list[tuple[float, float]]:
    """(bytes, seconds) of one `op` of a float32 tensor of each size over `group` (p2p: rank 0 to rank 1 and back, halved),
    issued through `behemoth.comm` as training issues them; every rank of `start` (default: `group`) begins each
    timed run together."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    out = []
    for nbytes in sizes:
        n = max(world, nbytes // 4 // world * world)
        full = torch.ones(n, device=device)
        shard = torch.ones(n // world, device=device)
        fn = {
            "all_reduce": lambda: all_reduce(full, group),
            "all_gather": lambda: all_gather(full, shard, group),
            "reduce_scatter": lambda: reduce_scatter(shard, full, group),
            "all_to_all": lambda: all_to_all(torch.empty_like(full), full, group),
            "p2p": lambda: ping_pong(full, rank, group),
        }[op]
        seconds = timed(fn, 5, device, start or group)
        out.append((float(n * 4), seconds / 2 if op == "p2p" else seconds))
    return out


def group_collectives(sizes: tuple[int, ...], device: torch.device, world: dist.ProcessGroup) -> dict[int, dict[str, list[tuple[float, float]]]]:
    """{group size: {op: `collective_curve`}} on the world cut into groups of consecutive ranks of each size (powers of
    two from 2 below the world's size that divide it), every group running at once, as a job's tensor- or
    data-parallel groups do: on shared cores a pair's all-reduce costs far less than the whole world's, which the
    world's curve alone would charge it. This rank's group's curves."""
    n, rank, out = dist.get_world_size(world), dist.get_rank(world), {}
    size = 2
    while size < n:
        if n % size == 0:
            groups = [dist.new_group(list(range(i, i + size))) for i in range(0, n, size)]  # every rank creates every group
            mine = groups[rank // size]
            out[size] = {op: collective_curve(op, sizes, device, mine, world) for op in COLLECTIVES if op != "p2p"}
        size *= 2
    return out


def fit_link(op: str, curve: list[tuple[float, float]], ranks: int) -> tuple[float, float]:
    """(latency us, bus bandwidth GB/s): the latency is the fastest small message, the bandwidth what the largest
    message adds to it (robust to the noise of a shared machine, where a least-squares fit is not)."""
    points = sorted(curve)
    latency = min(s for _, s in points[:2])
    nbytes, seconds = points[-1]
    moved = nbytes * bus_factor(op, ranks)
    bandwidth = moved / max(seconds - latency, seconds * 0.05)
    return latency * 1e6, bandwidth / 1e9


def ping_pong(t: torch.Tensor, rank: int, group: dist.ProcessGroup) -> None:
    """Rank 0 sends to rank 1 and back; other ranks idle."""
    peer = {0: 1, 1: 0}.get(rank)
    if peer is None:
        return
    for send in (rank == 0, rank != 0):
        batch_p2p([P2P(send, t, peer)], group)[0].wait()


def wake_latency(
    device: torch.device, group: dist.ProcessGroup, nbytes: int = 2**16, seconds: float = 0.6, cores: int | None = None, rounds: int = 3
) -> float:
    """Microseconds a blocking message between two CPU processes takes beyond its idle latency while the node's other
    processes compute (the cost model's `HostSpec.wake_us`): where processes outnumber cores, the rank a message
    wakes waits for a core another rank is multiplying on (a scheduler slice at worst, nothing when it preempts). Ranks
    0 and 1 ping-pong `nbytes` for `seconds`, with every other rank idle, then with every other rank multiplying for as
    long, `rounds` times in alternation (the wait is bimodal and the load of a shared host drifts); the difference of
    the mean one-way times, at least 0. 0 without more processes than cores (nothing to wait for) or on a GPU."""
    world = dist.get_world_size(group)
    if device.type != "cpu" or world <= (cores or core_count()) or world < 3:
        return 0.0
    rank = dist.get_rank(group)
    message = torch.ones(nbytes // 4)
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))

    def one_way(busy: bool) -> float:
        barrier(group)
        start, trips = time.perf_counter(), 0
        message[0] = 0.0
        while rank < 2 and message[0] == 0.0:  # rank 0 flags the last trip in the message itself: both stop after it
            if rank == 0 and time.perf_counter() - start >= seconds:
                message[0] = 1.0
            ping_pong(message, rank, group)
            trips += 1
        while rank >= 2 and time.perf_counter() - start < seconds:
            if busy:
                a @ a
            else:
                time.sleep(0.01)
        took = torch.tensor([(time.perf_counter() - start) / (2 * trips) if trips else 0.0])
        all_reduce(took, group, op=dist.ReduceOp.MAX)  # rank 0's (and 1's) figure; the others report 0
        return float(took.item())

    ping_pong(message, rank, group)  # connect
    idle, loaded = [], []
    for _ in range(rounds):
        idle.append(one_way(False))
        loaded.append(one_way(True))
    return max(0.0, sum(loaded) / rounds - sum(idle) / rounds) * 1e6


def message_cpu(device: torch.device, group: dist.ProcessGroup, nbytes: int = 2**16, exchanges: int = 150, rounds: int = 3) -> float:
    """Microseconds of CPU a CPU process spends per message it sends or receives when it computes between messages, as a
    pipeline stage does (the cost model's `HostSpec.message_cpu_us`): ranks 0 and 1 each run `exchanges` times a fixed
    block of products then one send and one receive of `nbytes` to each other, and the same products without the
    messages; the difference of the process CPU time (every thread: gloo's transport thread included) over the messages'
    ends, the median of `rounds` alternations, averaged over both ranks. A tight ping-pong costs a fraction of it (the
    threads stay awake and the caches warm); between computations each message wakes the transport and the waiter
    afresh. 0 on a GPU (the transport is the device's) or for one process."""
    if device.type != "cpu" or dist.get_world_size(group) < 2:
        return 0.0
    rank = dist.get_rank(group)
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    send, recv = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    peer = {0: 1, 1: 0}.get(rank)

    def cpu_seconds(messages: bool) -> float:
        barrier(group)
        start = time.process_time()
        for _ in range(exchanges if peer is not None else 0):
            for _ in range(4):
                a @ a
            if messages and peer is not None:
                for pending in batch_p2p([P2P(True, send, peer), P2P(False, recv, peer)], group):
                    pending.wait()
        return time.process_time() - start

    cpu_seconds(True)  # connect and warm
    per_end = []
    for _ in range(rounds):
        with_messages = cpu_seconds(True)
        per_end.append(max(0.0, with_messages - cpu_seconds(False)) / (2 * exchanges))
    mine = torch.tensor([statistics.median(per_end) if peer is not None else 0.0])
    all_reduce(mine, group)  # ranks 0 and 1 measured; the others add 0
    return float(mine.item()) / 2 * 1e6
