"""Point-to-point timings of `behemoth calibrate`: the ping-pong every p2p latency is measured by, and what a message
waits for a core where the processes outnumber the cores (`HostSpec.wake_us`)."""

from __future__ import annotations

import os
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
