"""Runs a sweep: asks the policy what runs next, hands segments to the executor, records what finished, says so."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from behemoth.sweep.executors import Executor, Job, LocalSlots, Outcome, Segment
from behemoth.sweep.halving import Halving, Policy, make_policy
from behemoth.sweep.leaderboard import leaderboard_rows, print_table, write_leaderboard
from behemoth.sweep.setup import SweepSetup, append_event, read_events

Say = Callable[[str], None]


def capacity_of(setup: SweepSetup) -> int:
    """Trials at once: 1 in sequence; concurrent: sweep.concurrency, else as many as this machine's GPUs (or cores) hold."""
    from behemoth.sweep.executors import visible_gpus

    options = setup.spec.sweep
    if options.execution == "sequential" and options.backend == "local":
        return 1
    if options.concurrency:
        return min(options.concurrency, len(setup.trials))
    if options.execution == "hydra":  # every trial interleaved, shard by shard
        return len(setup.trials)
    units = len(visible_gpus()) or len(os.sched_getaffinity(0))
    return max(1, min(len(setup.trials), units // setup.nproc))


def make_executor(setup: SweepSetup, segment: Segment) -> Executor:
    if setup.spec.sweep.execution == "hydra":
        from behemoth.sweep.hydra.scheduler import hydra_executor

        return hydra_executor(setup, capacity_of(setup))
    if setup.spec.sweep.backend == "ray":
        from behemoth.sweep.ray_backend import RayTasks

        options = setup.spec.sweep
        return RayTasks(options.ray, setup.nproc, 1 if options.execution == "sequential" else options.concurrency, segment)
    return LocalSlots(capacity_of(setup), setup.nproc, segment)


class SweepRunner:
    """One sweep's loop; the policy and the events log are its whole state, so a killed sweep replays both and goes on."""

    def __init__(self, setup: SweepSetup, say: Say = print) -> None:
        self.setup, self.say = setup, say
        self.names = [t.name for t in setup.trials]
        self.policy: Policy = make_policy(self.names, setup.steps, setup.spec.sweep.prune)
        self.wall: dict[str, float] = {}
        self.errors: dict[str, str] = {}
        self.status = {name: "pending" for name in self.names}
        self.replay(read_events(setup.events))

    def replay(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            trial = event["trial"]
            self.wall[trial] = self.wall.get(trial, 0.0) + event.get("wall_s", 0.0)
            if event["event"] == "segment":
                self.policy.report(trial, event["step"], event["val_loss"])
            elif event["event"] == "failed":
                self.policy.fail(trial)
                self.errors[trial] = event["error"]
        if isinstance(self.policy, Halving):
            self.policy.replay_promotions()
        self.status = {name: self.policy.status(name) for name in self.names}
        if events:
            kept = sum(s in ("done", "failed", "stopped") for s in self.status.values())
            self.say(f"sweep: resuming {self.setup.dir}: {kept} of {len(self.names)} trials finished, the others continue")

    def run(self, executor: Executor) -> list[dict[str, Any]]:
        """Run until no segment is left; the leaderboard rows at the end."""
        t0 = time.time()
        self.say(self.launch_line(executor))
        try:
            self.loop(executor)
        finally:
            executor.close()
        rows = self.leaderboard()
        print_table(rows, self.say)
        write_leaderboard(rows, self.setup, plot=True)
        self.say(f"sweep: done in {time.time() - t0:.0f} s: {self.setup.dir}/leaderboard.csv leaderboard.md curves.png")
        return rows

    def loop(self, executor: Executor) -> None:
        running = 0
        while True:
            while running < executor.capacity and (segment := self.policy.next_job()) is not None:
                executor.submit(self.job(*segment))
                running += 1
            if running == 0:
                return
            job, outcome = executor.wait()
            running -= 1
            self.finished(job, outcome)

    def job(self, trial: str, step: int) -> Job:
        folder = self.setup.trial_dir(trial)
        start = self.policy.reached(trial) or checkpoint_step(folder)
        where = f"resumes at step {start}" if start else "starts"
        diff = next(t.diff() for t in self.setup.trials if t.name == trial)
        self.say(f"sweep: {trial} {where} -> step {step} ({diff})")
        self.status[trial] = "running"
        return {"trial": trial, "dir": str(folder), "config": str(folder / "trial.yaml"), "nproc": self.setup.nproc, "stop_at": step}

    def finished(self, job: Job, outcome: Outcome) -> None:
        """Record one ended segment: its validation loss at the step it ran to, or the error that ended it."""
        trial, step = job["trial"], job["stop_at"]
        val = val_loss_at(Path(job["dir"]), step) if outcome["rc"] == 0 else None
        val = val if val is None or math.isfinite(val) else math.inf  # a diverged trial ranks last
        error = outcome.get("error") or f"no validation loss at step {step} in {job['dir']}/metrics.jsonl"
        self.wall[trial] = self.wall.get(trial, 0.0) + outcome["wall_s"]
        if val is None:
            self.policy.fail(trial)
            self.errors[trial] = error
            append_event(self.setup.events, {"trial": trial, "event": "failed", "step": step, "error": error, "wall_s": outcome["wall_s"]})
            self.say(f"sweep: {trial} failed before step {step} ({outcome['wall_s']:.1f} s): {error}")
        else:
            self.policy.report(trial, step, val)
            append_event(self.setup.events, {"trial": trial, "event": "segment", "step": step, "val_loss": val, "wall_s": outcome["wall_s"]})
            self.say(f"sweep: {trial} reached step {step}: validation loss {val:.4f} ({outcome['wall_s']:.1f} s)")
        self.announce()
        write_leaderboard(self.leaderboard(), self.setup, plot=False)

    def announce(self) -> None:
        """One line for each trial the policy has just finished with: trained to the end, or stopped at a rung."""
        for name in self.names:
            now = self.policy.status(name)
            if now != self.status[name] and now in ("done", "stopped"):
                reached = self.policy.reached(name)
                why = f"stopped at step {reached} (not in its rung's top 1/{self.policy.eta})" if isinstance(self.policy, Halving) else ""
                self.say(f"sweep: {name} {why or 'done'}" if now == "stopped" else f"sweep: {name} done: trained to step {reached}")
            self.status[name] = now

    def launch_line(self, executor: Executor) -> str:
        opts = self.setup.spec.sweep
        prune = f", pruned by {opts.prune.method} (rungs {self.policy.rungs})" if isinstance(self.policy, Halving) and opts.prune else ""
        return (
            f"sweep: {len(self.names)} trials, {opts.execution} on {opts.backend} ({executor.capacity} at once, "
            f"{self.setup.nproc} process(es) each){prune} -> {self.setup.dir}"
        )

    def leaderboard(self) -> list[dict[str, Any]]:
        return leaderboard_rows(self.setup, {n: self.policy.status(n) for n in self.names}, self.wall, self.errors)


def checkpoint_step(run_dir: Path) -> int:
    """The step of a run directory's latest checkpoint, or of a hydra trial's saved state (0: none)."""
    for latest in (run_dir / "checkpoints" / "latest", run_dir / "hydra" / "latest"):
        if latest.is_file():
            try:
                return int(latest.read_text().strip().removeprefix("step_"))
            except ValueError:
                return 0
    return 0


def val_loss_at(run_dir: Path, step: int) -> float | None:
    """The validation loss metrics.jsonl records at `step` (the last such record: a resumed run rewrites its tail)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    found = None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step") == step and "val_loss" in record:
            found = float(record["val_loss"])
    return found
