"""Hydra's scheduler as a sweep executor: the runner submits trial segments (a trial to a step), and the scheduler
interleaves the shard tasks of every submitted trial over the workers. Each free worker slot gets the ready task of the
trial with the longest remaining time, priced with the shard times measured so far (re-measured after every task). A
worker holds two tasks: the one running and the next, whose shard it prefetches meanwhile."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from behemoth.config import load_config
from behemoth.errors import BehemothError
from behemoth.sweep.executors import Job, Outcome, stop_worker
from behemoth.sweep.hydra import artifacts, wire
from behemoth.sweep.hydra.join import Joins, splittable
from behemoth.sweep.hydra.shards import plan_shards
from behemoth.sweep.hydra.trial import Chain, HydraTrial, Task, unsupported
from behemoth.sweep.hydra.worker import trial_model, worker_main
from behemoth.sweep.setup import SweepSetup

DEPTH = 2  # tasks a worker holds: the running one and the prefetched next


@dataclass
class Running:
    """A submitted segment: its trial, its chain of tasks, the task it waits to run (None while one is in flight)."""

    job: Job
    trial: HydraTrial
    chain: Chain
    ready: Task | None = None
    in_flight: bool = False
    started: float = field(default_factory=time.time)


class Workers:
    """The worker processes (spawned, each with its share of threads) and the tasks each holds."""

    def __init__(self, count: int) -> None:
        self.ctx = mp.get_context("spawn")
        threads = max(1, int(os.environ.get("OMP_NUM_THREADS") or (os.cpu_count() or 1) // count))
        self.threads = threads
        self.procs: list[Any] = [None] * count
        self.conns: list[Connection] = [None] * count  # type: ignore[list-item]
        self.spawned = [0.0] * count
        self.startup_s = [0.0] * count  # spawn to the worker's first message (interpreter, imports)
        self.held: list[dict[int, str]] = [{} for _ in range(count)]  # worker -> task id -> trial
        self.known: list[set[str]] = [set() for _ in range(count)]  # worker -> keys of the spilled buffers it holds open
        for i in range(count):
            self.start(i)

    def start(self, i: int) -> None:
        ours, theirs = self.ctx.Pipe()
        self.spawned[i] = time.time()  # the wall clock: the worker says when its imports were done
        proc = self.ctx.Process(target=worker_main, args=(theirs, i, self.threads), name=f"hydra-worker-{i}", daemon=True)
        proc.start()
        theirs.close()
        self.procs[i], self.conns[i] = proc, ours
        self.known[i] = set()

    def send(self, worker: int, task: Task, buffers: dict[str, Any]) -> None:
        """A task by value, after the buffers it names that the worker does not hold yet (by their shared handles)."""
        new = {key: handle for key, handle in buffers.items() if key not in self.known[worker]}
        if new:
            wire.register(self.conns[worker], new)
            self.known[worker] |= set(new)
        wire.send(self.conns[worker], task)

    def forget(self, prefix: str) -> None:
        """Every worker lets go of the buffers whose keys start with `prefix` (a trial that is done)."""
        for i, known in enumerate(self.known):
            keys = [k for k in known if k.startswith(prefix)]
            if keys:
                known -= set(keys)
                with contextlib.suppress(OSError):
                    wire.forget(self.conns[i], keys)

    def free_slots(self) -> list[int]:
        """Workers that can take a task, the idle ones first."""
        return sorted((i for i in range(len(self.procs)) if len(self.held[i]) < DEPTH), key=lambda i: len(self.held[i]))

    def close(self) -> None:
        for proc, conn in zip(self.procs, self.conns):
            stop_worker(proc, conn)


class HydraExecutor:
    """The Executor protocol over Hydra's shard scheduler: `capacity` trials interleaved on `workers` workers."""

    def __init__(self, capacity: int, workers: int, *, budget_mb: float | None, spill: str, join: bool = True, report: Path | None = None) -> None:
        self.capacity, self.report, self.may_join = capacity, report, join
        self.budget = None if budget_mb is None else int(budget_mb * 2**20)
        self.spill = spill
        self.workers = Workers(workers)
        self.trials: dict[str, HydraTrial] = {}  # kept between a trial's segments (successive halving's rungs)
        self.running: dict[str, Running] = {}
        self.done: deque[tuple[Job, Outcome]] = deque()
        self.ids = itertools.count()
        self.tasks: dict[int, str] = {}  # task id -> trial
        self.sent: dict[int, Task] = {}  # task id -> the task as sent (a worker that dies is sent again those it had not begun)
        self.times: dict[tuple[str, str, int], float] = {}  # (trial, kind, shard) -> last measured seconds
        self.rate = 0.0  # seconds per (shard element x token), measured: prices tasks not yet measured
        self.resident_peak = [0] * len(self.workers.procs)
        self.busy_s = [0.0] * len(self.workers.procs)  # running tasks (and spilling back what they changed)
        self.load_s = [0.0] * len(self.workers.procs)  # copying shards in (the prefetch thread, beside a running task)
        self.plans: dict[str, dict[str, int]] = {}
        self.joins = Joins()  # tasks split over two workers (data parallelism while workers would idle)
        self.started = time.time()

    def submit(self, job: Job) -> None:
        name = job["trial"]
        try:
            trial = self.trials.get(name) or HydraTrial(name, folder_of(job), job["config"], self.budget, self.spill)
        except Exception as err:  # noqa: BLE001 - a trial that cannot start fails alone
            self.done.append((job, {"rc": 1, "error": one_line(err), "wall_s": 0.0}))
            artifacts.segment_failed(folder_of(job), one_line(err), trace_of(err))
            return
        self.trials[name] = trial
        plan = trial.plan
        self.plans[name] = {"shards": len(plan.shards), "state_bytes": plan.state_bytes, "max_shard": max(map(plan.resident_bytes, plan.shards))}
        run = Running(job, trial, trial.chain(job["stop_at"]))
        self.running[name] = run
        self.advance(run, None)

    def advance(self, run: Running, result: dict[str, Any] | None) -> None:
        """Hand the chain its last task's result; keep its next task ready, or end the segment (done or failed)."""
        name = run.job["trial"]
        try:
            task = next(run.chain) if result is None else run.chain.send(result)
            run.ready, run.in_flight = task, False
        except StopIteration:
            self.finish(name, {"rc": 0, "error": None, "wall_s": run.trial.busy_s})
        except Exception as err:  # noqa: BLE001 - BehemothError (a non-finite step) or a failed task
            self.finish(name, {"rc": 1, "error": one_line(err), "wall_s": run.trial.busy_s}, trace_of(err))

    def finish(self, name: str, outcome: Outcome, trace: str = "") -> None:
        """End a trial's segment; a trial done or failed lets its spilled shards go (a later rung keeps them)."""
        run = self.running.pop(name)
        run.trial.busy_s = 0.0
        if outcome["rc"] != 0:
            run.trial.failed(outcome["error"], trace)
        if outcome["rc"] != 0 or run.trial.step >= run.trial.cfg.train.steps:
            self.trials.pop(name, None)
            self.workers.forget(f"{name}/")
            run.trial.release()
        self.joins.drop(name, let_go=name not in self.trials)
        self.done.append((run.job, outcome))

    def wait(self) -> tuple[Job, Outcome]:
        while not self.done:
            self.dispatch()
            self.collect()
        return self.done.popleft()

    def dispatch(self) -> None:
        """Each free worker slot gets the ready task of the trial with the longest remaining time; while fewer trials are
        ready than workers are idle, that trial's task is split over two idle workers (data parallelism)."""
        while slots := self.workers.free_slots():
            ready = [r for r in self.running.values() if r.ready is not None and not r.in_flight]
            if not ready:
                return
            run = max(ready, key=self.remaining_s)
            idle = [w for w in slots if not self.workers.held[w]]
            task = run.ready
            assert task is not None
            if self.may_join and len(idle) >= 2 and len(ready) < len(idle) and splittable(task):
                self.join(run, task, idle[0], idle[1])
            else:
                self.send(run, task, slots[0])
            run.in_flight = True

    def send(self, run: Running, task: Task, worker: int) -> int:
        task_id = next(self.ids)
        self.sent[task_id] = {**task, "id": task_id}
        self.tasks[task_id] = run.job["trial"]
        self.deliver(worker, task_id)
        return task_id

    def deliver(self, worker: int, task_id: int) -> None:
        """Hand a sent task to a worker; one found dead is replaced (`worker_died`) and the task goes to the new one."""
        name = self.tasks[task_id]
        buffers = self.trials[name].buffers() | self.joins.buffers(name)
        try:
            self.workers.send(worker, self.sent[task_id], buffers)
        except OSError:  # its pipe is closed: it died since the last answer
            self.worker_died(worker)
            self.workers.send(worker, self.sent[task_id], buffers)
        self.workers.held[worker][task_id] = name

    def join(self, run: Running, task: Task, first: int, second: int) -> None:
        """The task's rows split over two workers: the first half on the spilled shard, the second on a snapshot of it."""
        a, b = self.joins.split(run.job["trial"], run.trial.host, task)
        self.joins.started(run.job["trial"], task, (self.send(run, a, first), self.send(run, b, second)))

    def collect(self) -> None:
        """Wait for a worker to answer (or die); hand each answer to its trial."""
        handles = {c: i for i, c in enumerate(self.workers.conns)} | {p.sentinel: i for i, p in enumerate(self.workers.procs)}
        if not any(self.workers.held):
            raise BehemothError("hydra: no task in flight and no segment finished", "this is a scheduler bug: report it")
        seen = set()
        for ready in wait(list(handles)):
            worker = handles[ready]
            if worker in seen:
                continue
            seen.add(worker)
            if ready is self.workers.conns[worker]:
                try:
                    answer = self.workers.conns[worker].recv()
                except (EOFError, OSError):
                    self.worker_died(worker)
                    continue
                if "ready" in answer:
                    self.workers.startup_s[worker] = answer["ready"] - self.workers.spawned[worker]
                    continue
                self.answered(worker, answer)
            else:
                self.worker_died(worker)

    def answered(self, worker: int, answer: dict[str, Any]) -> None:
        name = self.tasks.pop(answer["id"])
        self.sent.pop(answer["id"], None)
        self.workers.held[worker].pop(answer["id"], None)
        self.resident_peak[worker] = max(self.resident_peak[worker], answer.get("resident_peak", 0))
        self.busy_s[worker] += answer["wall_s"]
        self.load_s[worker] += answer.get("load_s", 0.0)
        run = self.running.get(name)
        if run is None:
            return
        kind, shard = run.ready["kind"], run.ready["shard"]  # type: ignore[index]
        merged = self.joins.answer(name, answer, run.trial.host)  # half of a joined task: None until the other answers
        if merged is None:
            return
        answer = merged
        run.trial.busy_s += answer["wall_s"]
        self.times[(name, kind, shard.index)] = answer["wall_s"]
        units = max(1, shard.parameters_numel) * max(1, sum(h.numel() for h in run.ready.get("inputs", [])))  # type: ignore[union-attr]
        self.rate = answer["wall_s"] / units if self.rate == 0 else 0.8 * self.rate + 0.2 * answer["wall_s"] / units
        if not answer["ok"]:
            run.chain.close()
            error = f"{where(run.trial, kind, shard.index)}: {answer['error']}"
            self.finish(name, {"rc": 1, "error": error, "wall_s": run.trial.busy_s}, answer.get("traceback", ""))
            return
        self.advance(run, answer)

    def worker_died(self, worker: int) -> None:
        """A worker that died fails the trial whose task it was running (the first it held that it had not answered);
        the tasks it held next, only prefetched (read from their spilled shards, never written back), go to the worker
        that replaces it, so their trials go on as if nothing had happened."""
        proc, conn = self.workers.procs[worker], self.workers.conns[worker]
        proc.join(timeout=5)
        with contextlib.suppress(EOFError, OSError):
            while conn.poll():  # what it answered before it died counts
                answer = conn.recv()
                if "id" in answer:
                    self.answered(worker, answer)
        held = sorted(self.workers.held[worker])
        self.workers.held[worker] = {}
        self.workers.start(worker)
        for i, task_id in enumerate(held):
            name = self.tasks.get(task_id)
            run = self.running.get(name) if name is not None else None
            if run is None:
                self.tasks.pop(task_id, None)
                self.sent.pop(task_id, None)
            elif i > 0:
                self.deliver(worker, task_id)
            else:
                task = self.sent.pop(task_id)
                self.tasks.pop(task_id)
                run.chain.close()
                error = f"hydra worker {worker} died ({exit_status(proc.exitcode)}) running {where(run.trial, task['kind'], task['shard'].index)}"
                self.finish(name, {"rc": 1, "error": error, "wall_s": run.trial.busy_s})  # type: ignore[arg-type]

    def remaining_s(self, run: Running) -> float:
        return remaining_s(run, self.times, self.rate)

    def close(self) -> None:
        """Stop the workers; write what they measured (resident model-state bytes, busy time) beside the leaderboard."""
        self.workers.close()
        if self.report is not None:
            self.report.write_text(json.dumps(summary(self), indent=1) + "\n")


def summary(ex: HydraExecutor) -> dict[str, Any]:
    """hydra.json: the budget, each worker's peak resident model-state bytes, busy, copy-in and start-up seconds, each
    trial's shards, state bytes and tasks run joined."""
    return {
        "budget_bytes": ex.budget,
        "workers": len(ex.workers.procs),
        "resident_peak_bytes": ex.resident_peak,
        "busy_s": [round(b, 3) for b in ex.busy_s],
        "load_s": [round(b, 3) for b in ex.load_s],
        "startup_s": [round(b, 3) for b in ex.workers.startup_s],
        "tasks": next(ex.ids),
        "wall_s": round(time.time() - ex.started, 3),
        "trials": {name: plan | {"joined_tasks": ex.joins.count.get(name, 0)} for name, plan in ex.plans.items()},
    }


def remaining_s(run: Running, times: dict[tuple[str, str, int], float], rate: float) -> float:
    """The trial's remaining time: its tasks left, each priced by its last measured time (or the measured rate)."""
    trial, name = run.trial, run.job["trial"]
    tokens = trial.cfg.train.global_batch * trial.cfg.seq_len
    total = 0.0
    for (kind, s), count in trial.remaining(run.job["stop_at"]).items():
        measured = times.get((name, kind, s))
        total += count * (measured if measured is not None else trial.plan.shards[s].parameters_numel * tokens * (rate or 1.0))
    return total if math.isfinite(total) else 0.0


def folder_of(job: Job) -> Path:
    return Path(job["dir"])


def hydra_executor(setup: SweepSetup, capacity: int) -> HydraExecutor:
    """Hydra over --nproc workers, after every trial's config is checked (a trial hydra cannot run exactly is refused
    before any worker starts)."""
    options = setup.spec.sweep
    if options.backend != "local":
        raise BehemothError(f"sweep.execution=hydra with sweep.backend={options.backend}", "hydra runs on this machine: use backend local")
    budget = None if options.hydra.budget_mb is None else int(options.hydra.budget_mb * 2**20)
    for trial in setup.trials:
        cfg = load_config(setup.trial_dir(trial.name) / "trial.yaml")
        why = unsupported(cfg)
        if why:
            raise BehemothError(f"{trial.name} ({trial.diff()}): hydra execution does not run {why}", "use sweep.execution=sequential or concurrent")
        try:
            plan_shards(trial_model(cfg), budget)
        except BehemothError as err:
            raise BehemothError(f"{trial.name} ({trial.diff()}): {err}") from None
    hydra = options.hydra
    return HydraExecutor(capacity, setup.nproc, budget_mb=hydra.budget_mb, spill=hydra.spill, join=hydra.join, report=setup.dir / "hydra.json")


def where(trial: HydraTrial, kind: str, shard: int) -> str:
    """A task in words: its shard, its kind, the step it belongs to (a validation: the step it validates)."""
    return f"shard {shard} validate at step {trial.step}" if kind == "validate" else f"shard {shard} {kind} of step {trial.step + 1}"


def exit_status(code: int | None) -> str:
    """How a process ended, in words: the signal that killed it, or its exit code."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def trace_of(err: BaseException) -> str:
    """The traceback of an error behemoth did not raise on purpose (a BehemothError says all in its line)."""
    return "" if isinstance(err, BehemothError) else "".join(traceback.format_exception(err))


def one_line(err: BaseException) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0][:300]
