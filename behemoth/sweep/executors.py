"""Where trial segments run: slots of this machine (each a process of its own, reused for segment after segment) or Ray
tasks. Each runs one segment function (`behemoth train` in that process) and hands back its outcome."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, Protocol

Job = dict[str, Any]  # trial, dir, config, nproc, stop_at, log
Outcome = dict[str, Any]  # rc, error, wall_s
Segment = Callable[[Job], Outcome]


class Executor(Protocol):
    capacity: int

    def submit(self, job: Job) -> None: ...

    def wait(self) -> tuple[Job, Outcome]: ...

    def close(self) -> None: ...


def slot_environments(capacity: int, nproc: int) -> list[dict[str, str]]:
    """Each slot's share of this machine: its GPUs when there are enough for every slot's processes (else all are shared),
    its cores (pinned when there are enough), and OMP_NUM_THREADS (as set by the user, else cores / processes at once)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    gpus = visible_gpus()
    per_slot = max(1, len(cores) // capacity)
    out = []
    for i in range(capacity):
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(max(1, per_slot // nproc))}
        if len(cores) >= capacity * nproc and capacity > 1:
            env["BEHEMOTH_SWEEP_CORES"] = ",".join(str(c) for c in cores[i * per_slot : (i + 1) * per_slot])
        if gpus and len(gpus) >= capacity * nproc:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * nproc : (i + 1) * nproc])
        out.append(env)
    return out


def visible_gpus() -> list[str]:
    """The GPUs this process may use, without importing torch (the sweep's own process stays light)."""
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [g for g in given.split(",") if g.strip()]
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


def slot_main(conn: Connection, env: dict[str, str], segment: Segment) -> None:
    """A slot process: take its share of the machine, then run segments until told to stop (or the sweep is gone)."""
    os.environ.update(env)
    cores = env.get("BEHEMOTH_SWEEP_CORES")
    if cores:
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    die_with_parent()
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        conn.send(segment(job))


def die_with_parent() -> None:
    """On Linux, a slot is killed with the sweep's process (a killed sweep leaves no trial training behind)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class LocalSlots:
    """`capacity` slot processes on this machine, started when first needed; a slot that dies is replaced."""

    def __init__(self, capacity: int, nproc: int, segment: Segment) -> None:
        self.capacity, self.segment = capacity, segment
        self.envs = slot_environments(capacity, nproc)
        self.ctx = mp.get_context("spawn")  # a fresh interpreter: no state of the sweep's process leaks into a trial
        self.slots: list[tuple[mp.process.BaseProcess, Connection] | None] = [None] * capacity
        self.busy: dict[int, Job] = {}

    def start_slot(self, i: int) -> tuple[mp.process.BaseProcess, Connection]:
        ours, theirs = self.ctx.Pipe()
        # not a daemon: a trial with --nproc > 1 starts worker processes of its own
        proc = self.ctx.Process(target=slot_main, args=(theirs, self.envs[i], self.segment), name=f"sweep-slot-{i}")
        proc.start()
        theirs.close()
        self.slots[i] = (proc, ours)
        return proc, ours

    def submit(self, job: Job) -> None:
        i = next(i for i in range(self.capacity) if i not in self.busy)
        _, conn = self.slots[i] or self.start_slot(i)
        conn.send(job)
        self.busy[i] = job

    def wait(self) -> tuple[Job, Outcome]:
        """The next segment to finish, and how it ended (a slot process that died ends its segment as a failure)."""
        handles = {}
        for i in self.busy:
            proc, conn = self.slots[i]  # type: ignore[misc]
            handles[conn] = handles[proc.sentinel] = i
        ready = wait(list(handles))
        i = handles[ready[0]]
        proc, conn = self.slots[i]  # type: ignore[misc]
        job = self.busy.pop(i)
        if conn.poll():
            return job, conn.recv()
        proc.join(timeout=5)
        self.slots[i] = None
        return job, {"rc": proc.exitcode or 1, "error": f"the trial's process died (exit code {proc.exitcode})", "wall_s": 0.0}

    def close(self) -> None:
        """Stop every slot: idle ones when told, busy ones (an interrupted sweep) at once; their checkpoints stay."""
        for i, slot in enumerate(self.slots):
            if slot is None:
                continue
            proc, conn = slot
            if i in self.busy:
                proc.kill()
                proc.join()
            else:
                stop_worker(proc, conn)


def stop_worker(proc: Any, conn: Connection, timeout_s: float = 10.0) -> None:
    """Ask a worker process to finish (None on its pipe), and kill it if it has not within `timeout_s`."""
    try:
        conn.send(None)
    except OSError:  # it is gone already
        pass
    proc.join(timeout=timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
