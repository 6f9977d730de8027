"""Point-to-point timings of `behemoth calibrate`: the ping-pong every p2p latency is measured by, what a message
waits for a core where the processes outnumber the cores (`HostSpec.wake_us`), and the CPU a process spends on a message
it sends or receives between computations (`HostSpec.message_cpu_us`)."""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from behemoth.comm import P2P, all_reduce, barrier, batch_p2p


def core_count() -> int:
    """CPU cores this process may run on (the node's processes share them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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
