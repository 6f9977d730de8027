"""The per-process flight recorder: its ring, its heartbeat (armed in a job of several ranks), the watchdog run on
each beat, and the one-line `HangError` of a failed wait, with every ring it has written to run_dir/hang/."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist

from behemoth.errors import ERROR_PREFIX, BehemothError
from behemoth.flight.diagnose import diagnose, hang_line
from behemoth.flight.heartbeat import Heartbeat, heartbeat_store
from behemoth.flight.ring import OpRecord, Ring, Snapshot

GRACE_S = 5.0  # the watchdog's margin over c10d's own timeout
SELF_PAUSED = "itself did not run"  # a rank's clause about its own stop: its line is then not the run's cause
HANG_FIX = "see those ranks' logs; raise {} if they are only slow"


class HangError(BehemothError):
    """A collective or transfer that failed or timed out, with the ranks it waited for (`diagnosis`: the line without
    the rank that reports it, for callers that say more about where they waited)."""

    def __init__(self, rank: int, diagnosis: str, fix: str, *, timed_out: bool = True) -> None:
        self.diagnosis, self.timed_out = diagnosis, timed_out  # not timed out: a peer went away (its own failure is the cause)
        super().__init__(f"rank {rank}: {diagnosis}", fix)


class PeerSnapshots(dict[int, "Snapshot | None"]):
    """The peers' published snapshots, each read from the store the first time a diagnosis asks for it (and kept)."""

    def __init__(self, heartbeat: Heartbeat | None) -> None:
        super().__init__()
        self.heartbeat = heartbeat

    def __missing__(self, rank: int) -> Snapshot | None:
        snap = self[rank] = self.heartbeat.published(rank) if self.heartbeat is not None else None
        return snap


class FlightRecorder:
    """This process's ring of recent operations and counters, and (armed) its heartbeat to the other ranks."""

    def __init__(self) -> None:
        self.ring = Ring()
        self.heartbeat: Heartbeat | None = None
        self.run_dir: Path | None = None
        self.timeout_s = 300.0
        self.rank = 0

    # recording (main thread): the ring's
    def begin(self, op: str, group: dist.ProcessGroup, *, peer_in_group: int | None = None, nbytes: int = 0) -> OpRecord:
        return self.ring.begin(op, group, peer_in_group=peer_in_group, nbytes=nbytes)

    def attach(self, rec: OpRecord, work: object) -> None:
        self.ring.attach(rec, work)

    def end(self, rec: OpRecord) -> None:
        self.ring.end(rec)

    def snapshot(self) -> Snapshot:
        return self.ring.snapshot(self.rank)

    # the heartbeat and the watchdog
    def arm(self, *, run_dir: str | Path | None, timeout_s: float) -> None:
        """Start publishing heartbeats (a job of several ranks only) and watching this rank's waits."""
        self.disarm()
        self.run_dir, self.timeout_s, self.rank = Path(run_dir) if run_dir else None, timeout_s, dist.get_rank()
        self.ring.reset()  # every rank of the job arms at the same point (a process may run several jobs in turn)
        if dist.get_world_size() == 1:
            return
        try:
            store = heartbeat_store(timeout_s)
        except Exception:  # no store to publish to: diagnoses use this rank's ring only
            store = None
        self.heartbeat = Heartbeat(self.rank, timeout_s, self.snapshot, self.watch)
        self.heartbeat.start(store)

    @property
    def armed(self) -> bool:
        return self.heartbeat is not None and self.heartbeat.running

    def disarm(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.heartbeat = None

    def published(self, rank: int) -> Snapshot | None:
        """Rank `rank`'s last heartbeat (this rank's own snapshot for itself), if it published one."""
        if rank == self.rank:
            return self.snapshot()
        return self.heartbeat.published(rank) if self.heartbeat is not None else None

    def watch(self) -> None:
        """Fail this process if a wait has outlived c10d's timeout by GRACE_S (a wait that never returns)."""
        stuck = self.ring.stuck(time.time(), self.timeout_s + GRACE_S)
        if stuck:
            err = self.failure(min(stuck, key=lambda r: r.start), None)
            print(f"{ERROR_PREFIX}{err}", file=sys.stderr, flush=True)
            os._exit(3)

    # diagnosis
    def failure(self, rec: OpRecord, err: BaseException | None, timeout_s: float | None = None, limit_name: str = "run.timeout_s") -> HangError:
        """The one-line error for a failed or timed-out `rec` (waited for at most `timeout_s`, default run.timeout_s; the
        message names the setting as `limit_name`): who never arrived; the rings are written to the run directory."""
        now = time.time()
        waited, limit = now - rec.start, timeout_s if timeout_s is not None else self.timeout_s
        if not self.armed:
            self.rank = dist.get_rank()
        timed_out = err is None or waited >= limit - 0.5
        peers = PeerSnapshots(self.heartbeat)
        stale_s = self.heartbeat.stale_s if self.heartbeat is not None else float("inf")
        culprits = diagnose(rec, peers, me=self.rank, now=now, stale_s=stale_s, timed_out=timed_out)
        paused = self.heartbeat.not_running_since(rec.start, now) if self.heartbeat is not None else 0.0
        if paused > stale_s:  # this rank itself was stopped during the wait: what it saw of the peers is not the cause
            culprits = [f"rank {self.rank} {SELF_PAUSED} for {paused:.0f} s of the wait (stopped, suspended or starved)", *culprits]
        folder = self.write_rings(peers)
        where = f"; rings in {folder}" if folder else ""
        line = hang_line(rec, culprits, waited=waited, limit_s=limit, limit_name=limit_name, timed_out=timed_out, err=err)
        return HangError(self.rank, line + where, HANG_FIX.format(limit_name), timed_out=timed_out)

    def write_rings(self, snaps: Mapping[int, Snapshot | None]) -> Path | None:
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


def nccl_flight_env(run_dir: str | Path) -> dict[str, str]:
    """Environment that makes NCCL's own flight recorder keep a trace and dump it into run_dir/hang/ on a timeout
    (nothing where there is no GPU)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(Path(run_dir) / "hang" / "nccl_trace_rank_"),
    }


RECORDER = FlightRecorder()
