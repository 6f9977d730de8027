"""The ring of this process's recent collectives and transfers, and the counters every rank keeps alike.

Each operation gets a sequence number per key (a group, or a sender -> receiver path in it), counted the same way
on every rank involved, so comparing two ranks' counters says who has not reached an operation yet.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, TypedDict

import torch.distributed as dist

RING = 64


@dataclass
class OpRecord:
    """One collective or transfer as this rank issued it (ranks are global ranks)."""

    op: str
    group: str  # the group's name: dp, tp, pp, world, ...
    ranks: list[int]  # its members
    key: str  # what the sequence number counts: the group, or a sender -> receiver path in it
    seq: int  # the how-many-th operation on `key` this is, counted alike on every rank involved
    start: float  # time.time() when issued
    peer: int | None = None
    nbytes: int = 0
    end: float | None = None

    def describe(self) -> str:
        where = f"from rank {self.peer}" if self.op == "recv" else f"to rank {self.peer}" if self.op == "send" else ""
        return f"{self.op} #{self.seq} {where + ' ' if where else ''}on group {self.group} (ranks {','.join(map(str, self.ranks))})"

    @property
    def awaited(self) -> list[int]:
        """The ranks this operation needs: the peer of a transfer, every member of a collective."""
        return self.ranks if self.peer is None else [self.peer]


class Snapshot(TypedDict):
    """What a rank publishes as its heartbeat: its ring (`OpRecord`s as dicts), its counters, and when."""

    rank: int
    pid: int
    host: str
    t: float
    counters: dict[str, int]
    ring: list[dict[str, Any]]


def group_info(group: dist.ProcessGroup) -> tuple[str, list[int]]:
    """(name, global ranks) of a process group: a mesh dimension's name, `world`, or the group's own description."""
    desc = str(getattr(group, "group_desc", "") or "")
    if group is dist.group.WORLD or desc == "default_pg":
        return "world", dist.get_process_group_ranks(group)
    return (desc.removeprefix("mesh_") if desc not in ("", "undefined") else "group"), dist.get_process_group_ranks(group)


def op_key(name: str, ranks: list[int], op: str, me: int, peer: int | None) -> str:
    """What an operation's sequence number counts: the group, or for a transfer the sender -> receiver path in it."""
    key = f"{name}:{','.join(map(str, ranks))}"
    if peer is None:
        return key
    return key + (f":{me}->{peer}" if op == "send" else f":{peer}->{me}")


class Ring:
    """The last `RING` operations of this process, its counters, and the ones still waited for (with their work)."""

    def __init__(self, size: int = RING) -> None:
        self.records: deque[OpRecord] = deque(maxlen=size)
        self.counters: dict[str, int] = {}
        self.inflight: dict[int, tuple[OpRecord, Any]] = {}
        self.groups: dict[int, tuple[str, list[int]]] = {}
        self.lock = threading.Lock()

    def reset(self) -> None:
        """Count afresh (every rank of a new job does so at the same point, with new groups)."""
        with self.lock:
            self.counters.clear()
            self.groups.clear()

    def begin(self, op: str, group: dist.ProcessGroup, *, peer_in_group: int | None = None, nbytes: int = 0, work: Any = None) -> OpRecord:
        """Record an operation as issued; for a transfer, `peer_in_group` is the peer's rank in `group`."""
        info = self.groups.get(id(group))
        if info is None:
            info = self.groups[id(group)] = group_info(group)
        name, ranks = info
        peer = ranks[peer_in_group] if peer_in_group is not None else None
        key = op_key(name, ranks, op, dist.get_rank() if peer is not None else -1, peer)
        with self.lock:
            seq = self.counters[key] = self.counters.get(key, 0) + 1
            rec = OpRecord(op, name, ranks, key, seq, time.time(), peer, nbytes)
            self.records.append(rec)
            self.inflight[id(rec)] = (rec, work)
        return rec

    def attach(self, rec: OpRecord, work: Any) -> None:
        """The c10d work of an operation recorded before it was issued (the watchdog asks it whether it completed)."""
        with self.lock:
            if id(rec) in self.inflight:
                self.inflight[id(rec)] = (rec, work)

    def end(self, rec: OpRecord) -> None:
        with self.lock:
            rec.end = time.time()
            self.inflight.pop(id(rec), None)

    def snapshot(self, rank: int) -> Snapshot:
        """What this rank publishes: its ring, its counters and the time."""
        with self.lock:
            ring = [asdict(r) for r in self.records]
            counters = dict(self.counters)
        return Snapshot(rank=rank, pid=os.getpid(), host=socket.gethostname(), t=time.time(), counters=counters, ring=ring)

    def stuck(self, now: float, limit_s: float) -> list[OpRecord]:
        """Operations waited for longer than `limit_s` whose work has not completed."""
        with self.lock:
            return [rec for rec, work in self.inflight.values() if now - rec.start > limit_s and not (work is not None and work.is_completed())]
