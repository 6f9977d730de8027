"""A flight recorder of this process's collectives and transfers, and a watchdog that names what a hung wait waits for.

Every collective and point-to-point transfer behemoth issues goes through `behemoth.comm`, which records it here:
op, group, peer, a sequence number per group (per sender -> receiver path for transfers), start and end time, in a
ring of the last `RING` operations. Once armed (a job of several ranks), a thread on every rank publishes its ring
and counters to the job's store as a heartbeat. When a wait fails (c10d's timeout is run.timeout_s, or a peer
died), `failure` compares the peers' published counters with this rank's and says, in one line, which rank(s)
never arrived: the ones whose heartbeat stopped (a stopped, hung or dead process) or, following the chain, the
rank a busy peer is itself waiting for. Every ring it has is written to the run directory's `hang/` folder.

The recorder is per process, like a logger: it holds no process group, only what this process did. If a wait
does not return at all (no c10d timeout fires), the watchdog thread fails the process itself at run.timeout_s + 5 s.
On NCCL, its own flight recorder is switched on too (`nccl_flight_env`).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from behemoth.errors import ERROR_PREFIX, BehemothError

RING = 64
GRACE_S = 5.0  # the watchdog's margin over c10d's own timeout


class HangError(BehemothError):
    """A collective or transfer that failed or timed out, with the ranks it waited for (`diagnosis`: the line without
    the rank that reports it, for callers that say more about where they waited)."""

    def __init__(self, rank: int, diagnosis: str, fix: str, *, timed_out: bool = True) -> None:
        self.diagnosis, self.timed_out = diagnosis, timed_out  # not timed out: a peer went away (its own failure is the cause)
        super().__init__(f"rank {rank}: {diagnosis}", fix)


@dataclass
class OpRecord:
    """One collective or transfer as this rank issued it (ranks are global ranks)."""

    op: str
    group: str           # the group's name: dp, tp, pp, world, ...
    ranks: list[int]     # its members
    key: str             # what the sequence number counts: the group, or a sender -> receiver path in it
    seq: int             # the how-many-th operation on `key` this is, counted alike on every rank involved
    start: float         # time.time() when issued
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


def group_info(group: dist.ProcessGroup) -> tuple[str, list[int]]:
    """(name, global ranks) of a process group: a mesh dimension's name, `world`, or the group's own description."""
    desc = str(getattr(group, "group_desc", "") or "")
    if group is dist.group.WORLD or desc == "default_pg":
        return "world", dist.get_process_group_ranks(group)
    return (desc.removeprefix("mesh_") if desc not in ("", "undefined") else "group"), dist.get_process_group_ranks(group)


class FlightRecorder:
    """This process's ring of recent operations, its counters, and (armed) its heartbeat to the other ranks."""

    def __init__(self) -> None:
        self.ring: deque[OpRecord] = deque(maxlen=RING)
        self.counters: dict[str, int] = {}
        self.inflight: dict[int, tuple[OpRecord, Any]] = {}
        self.lock = threading.Lock()
        self.groups: dict[int, tuple[str, list[int]]] = {}
        self.store: Any = None
        self.run_dir: Path | None = None
        self.timeout_s = 300.0
        self.rank = 0
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    # recording (main thread)
    def begin(self, op: str, group: dist.ProcessGroup, *, peer_in_group: int | None = None, nbytes: int = 0, work: Any = None) -> OpRecord:
        """Record an operation as issued; for a transfer, `peer_in_group` is the peer's rank in `group`."""
        info = self.groups.get(id(group))
        if info is None:
            info = self.groups[id(group)] = group_info(group)
        name, ranks = info
        key, peer = f"{name}:{','.join(map(str, ranks))}", None
        if peer_in_group is not None:
            me, peer = dist.get_rank(), ranks[peer_in_group]
            key += f":{me}->{peer}" if op == "send" else f":{peer}->{me}"
        with self.lock:
            seq = self.counters[key] = self.counters.get(key, 0) + 1
            rec = OpRecord(op, name, ranks, key, seq, time.time(), peer, nbytes)
            self.ring.append(rec)
            self.inflight[id(rec)] = (rec, work)
        return rec

    def attach(self, rec: OpRecord, work: Any) -> None:
        with self.lock:
            if id(rec) in self.inflight:
                self.inflight[id(rec)] = (rec, work)

    def end(self, rec: OpRecord) -> None:
        with self.lock:
            rec.end = time.time()
            self.inflight.pop(id(rec), None)

    def snapshot(self) -> dict[str, Any]:
        """What this rank publishes: its ring, its counters and the time."""
        with self.lock:
            ring = [asdict(r) for r in self.ring]
            counters = dict(self.counters)
        return {"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname(), "t": time.time(), "counters": counters, "ring": ring}

    # the heartbeat and watchdog thread
    @property
    def interval(self) -> float:
        return min(2.0, max(0.5, self.timeout_s / 10))

    def arm(self, *, run_dir: str | Path | None, timeout_s: float) -> None:
        """Start publishing heartbeats (a job of several ranks only) and watching this rank's waits."""
        self.disarm()
        self.run_dir, self.timeout_s, self.rank = Path(run_dir) if run_dir else None, timeout_s, dist.get_rank()
        with self.lock:  # every rank of the job arms at the same point, so counting starts afresh alike (a process may run
            self.counters.clear()  # several jobs one after another, each with new groups)
            self.groups.clear()
        if dist.get_world_size() == 1:
            return
        try:
            self.store = heartbeat_store(timeout_s)
        except Exception:  # no store to publish to: diagnoses use this rank's ring only
            self.store = None
        self.publish()  # at once: a rank that stops right away has still said where it was
        self.stop.clear()
        self.thread = threading.Thread(target=self._beat, name="behemoth-flight", daemon=True)
        self.thread.start()

    @property
    def armed(self) -> bool:
        return self.thread is not None

    def disarm(self) -> None:
        if self.thread is not None:
            self.stop.set()
            self.thread.join(timeout=5)
            self.thread = None
        self.store = None

    def publish(self) -> bool:
        """Put this rank's snapshot in the store; False if that failed."""
        try:
            if self.store is not None:
                self.store.set(str(self.rank), json.dumps(self.snapshot()))
            return True
        except Exception:
            return False

    def _beat(self) -> None:
        failures = 0
        while not self.stop.wait(self.interval):
            failures = 0 if self.publish() else failures + 1
            if failures > 5:  # the store is gone (its host died): diagnoses use this rank's ring only
                self.store = None
            self._watch()

    def _watch(self) -> None:
        """Fail this process if a wait has outlived c10d's timeout by GRACE_S (a wait that never returns)."""
        now = time.time()
        with self.lock:
            stuck = [rec for rec, work in self.inflight.values() if now - rec.start > self.timeout_s + GRACE_S
                     and not (work is not None and work.is_completed())]
        if stuck:
            err = self.failure(min(stuck, key=lambda r: r.start), None)
            print(f"{ERROR_PREFIX}{err}", file=sys.stderr, flush=True)
            os._exit(3)

    # diagnosis
    def published(self, rank: int) -> dict[str, Any] | None:
        """A peer's last heartbeat, if it published one."""
        if rank == self.rank:
            return self.snapshot()
        try:
            if self.store is not None and self.store.check([str(rank)]):
                return json.loads(self.store.get(str(rank)))
        except Exception:
            return None
        return None

    def failure(self, rec: OpRecord, err: BaseException | None, timeout_s: float | None = None) -> HangError:
        """The one-line error for a failed or timed-out `rec` (waited for at most `timeout_s`, default run.timeout_s): who
        never arrived; the rings are written to the run directory."""
        now = time.time()
        waited = now - rec.start
        limit = timeout_s if timeout_s is not None else self.timeout_s
        if not self.armed:
            self.rank = dist.get_rank()
        timed_out = err is None or waited >= limit - 0.5
        snaps: dict[int, dict[str, Any] | None] = {}
        culprits = self.blame(rec.key, rec.seq, rec.awaited, snaps, now, depth=0, timed_out=timed_out)
        how = f"waited {waited:.1f} s (run.timeout_s={limit:g})" if timed_out else f"failed after {waited:.1f} s ({c10d_reason(err)})"
        folder = self.write_rings(snaps)
        who = "; ".join(culprits) if culprits else "every rank of the group had arrived; the transfer itself stalled"
        where = f"; rings in {folder}" if folder else ""
        return HangError(self.rank, f"{rec.describe()} {how}: {who}{where}", "see those ranks' logs; raise run.timeout_s if they are only slow",
                         timed_out=timed_out)

    def stale_s(self) -> float:
        return 3 * self.interval + 1.0

    def blame(self, key: str, seq: int, ranks: list[int], snaps: dict[int, Any], now: float, depth: int, timed_out: bool = True) -> list[str]:
        """Why each other rank of `ranks` has not completed operation `seq` on `key`, following busy ranks' own waits.
        (After a fast failure, a peer's heartbeat is too recent to tell a dead rank from a live one.)"""
        out = []
        for r in ranks:
            if r == self.rank or r in snaps and depth > 0:
                continue
            snap = snaps[r] = self.published(r) if r not in snaps else snaps[r]
            if snap is None:
                out.append(f"rank {r} never published a heartbeat (it may not have started)")
                continue
            done = snap["counters"].get(key, 0)
            age = now - snap["t"]
            if age > self.stale_s():
                arrived = "never arrived" if done < seq else "arrived but stopped inside it"
                out.append(f"rank {r} {arrived} (its last op there: #{done}; no heartbeat for {age:.0f} s: stopped, hung or dead)")
            elif done < seq and not timed_out:
                out.append(f"rank {r} had not arrived (its last op there: #{done}; it failed or died, see its line)")
            elif done < seq:
                out.append(self.busy(r, snap, key, snaps, now, depth))
        return out

    def busy(self, r: int, snap: dict[str, Any], key: str, snaps: dict[int, Any], now: float, depth: int) -> str:
        """A live rank that has not reached the operation: what it waits in, and for whom."""
        waiting = [op for op in snap["ring"] if op["end"] is None]
        if not waiting or depth >= 3:
            return f"rank {r} never arrived (its last op there: #{snap['counters'].get(key, 0)}; it is alive and elsewhere)"
        op = OpRecord(**min(waiting, key=lambda o: o["start"]))
        inner = self.blame(op.key, op.seq, op.awaited, snaps, now, depth + 1)
        text = op.describe()
        return f"rank {r} never arrived: it waits in {text}" + (f", where {'; '.join(inner)}" if inner else "")

    def write_rings(self, snaps: dict[int, Any]) -> Path | None:
        """This rank's ring (always) and each peer's last published one (unless that rank wrote its own) to run_dir/hang/."""
        if self.run_dir is None:
            return None
        folder = self.run_dir / "hang"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for rank, snap in {**snaps, self.rank: self.snapshot()}.items():
                path = folder / f"rank_{rank}.json"
                if snap is None or (rank != self.rank and path.exists()):
                    continue
                tmp = path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps({**snap, "written_by": self.rank}, indent=1))
                os.replace(tmp, path)
        except OSError:
            return None
        return folder


def c10d_reason(err: BaseException | None) -> str:
    """The first line of c10d's error, without gloo's source location."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0] if err is not None else "no answer"
    return re.sub(r"^\[[^\]]*\.(cc|cpp|hpp|h):\d+\]\s*", "", text)[:140]


def heartbeat_store(timeout_s: float) -> Any:
    """A store client of this job's own for the heartbeats (the launcher's store when there is one), under a prefix
    unique to this attempt of the run."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=max(5.0, timeout_s)))
    else:
        base = dist.distributed_c10d._get_default_store()
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.PrefixStore(f"behemoth/flight/{attempt}/", base)


def nccl_flight_env(run_dir: str | Path) -> dict[str, str]:
    """Environment that makes NCCL's own flight recorder keep a trace and dump it into run_dir/hang/ on a timeout
    (nothing where there is no GPU)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_DUMP_TEMP_FILE": str(Path(run_dir) / "hang" / "nccl_trace_rank_")}


RECORDER = FlightRecorder()
