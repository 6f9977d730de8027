"""offload.commit=journal: a redo log that keeps an offloaded run's scratch resumable at its last committed step, in place.

One step of a journaled run, on each rank (its scratch folder `rank<r>/`):

1. backward writes each unit's reduced gradient shard to the gradient tier (the log: 4 bytes a parameter in float32,
   the compute dtype's size in bf16) instead of stepping it; the files are flushed once backward has finished;
2. once the norm is known (clipped, or not finite and skipped) `commit.pt` records the step: its number, the optimizer's
   step count, learning rate and clipping coefficient, the units owed a step, and what a resume restores besides the
   model states (this rank's RNG); it is written to a new file, flushed and renamed (atomic), and every rank waits for
   every other's before any unit changes;
3. the apply pass: each unit's new parameters and moments are written beside the old files and flushed, the unit is
   recorded in `applied.log` (one flushed line), and the new files are renamed over the old;
4. `state.pt` (step, step count, RNG) replaces the previous one; the commit record and the applied log are dropped.

Recovery (a resumed or restarted run): the ranks agree on the newest step every one of them committed. A rank whose
commit record is newer discards it (no rank applied anything of it: step 2 waits for all). Otherwise the owed units
are finished from the log: a unit recorded applied gets its renames redone, another is stepped again from its
unchanged old files and the logged gradient (the same inputs: the same bits). The scratch is then the committed step.
The disk holds the state, the gradient log and the units being written (one per I/O thread): no second copy.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from behemoth.errors import BehemothError
from behemoth.parallel.zero.tiers import FileTier

COMMIT, APPLIED, STATE = "commit.pt", "applied.log", "state.pt"


@dataclass
class StepRecord:
    """What a committed step needs to be finished and resumed from."""

    step: int  # the trainer's step count after it (the data position)
    count: int  # the optimizer's step count after it (skipped steps take none)
    lr: float = 0.0
    coef: float = 1.0
    units: list[int] = field(default_factory=list)  # the units owed this step
    rng: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)  # the step's logged loss, norm, lr (a recovered step's row)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def durable_save(value: dict[str, Any], path: Path) -> None:
    """`value` as `path`, atomically and flushed: a new file, fsync, rename, fsync of the folder."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(value, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_record(path: Path) -> StepRecord | None:
    if not path.is_file():
        return None
    return StepRecord(**torch.load(path, weights_only=True))


def fail_point(name: str, step: int) -> None:
    """BEHEMOTH_JOURNAL_KILL=<point>[:<step>]: the process kills itself there (SIGKILL; tests of recovery from a real kill).
    Points: before-commit (backward done, nothing committed), mid-apply (the first unit recorded applied, not renamed)."""
    point, _, at = os.environ.get("BEHEMOTH_JOURNAL_KILL", "").partition(":")
    if point == name and (not at or int(at) == step):
        os.kill(os.getpid(), signal.SIGKILL)


class Journal:
    """One rank's redo log over its disk tiers (`folder`: the rank's scratch folder)."""

    def __init__(self, folder: Path, params: FileTier, grads: FileTier, optimizer: FileTier) -> None:
        self.folder, self.params, self.grads, self.optimizer = Path(folder), params, grads, optimizer
        self.lock = threading.Lock()
        self.record: StepRecord | None = None  # the step being applied
        self.reopening = False  # a resume: the files are the scratch's own, opened as they are (nothing drawn)

    @property
    def resumable(self) -> bool:
        """Whether the folder holds a journaled scratch (a completed step, or step 0 once the run was materialized)."""
        return (self.folder / STATE).is_file()

    def start(self, record: StepRecord) -> None:
        """The scratch as materialized is step 0 (drawn from the seed, zero moments)."""
        for tier in (self.params, self.optimizer):
            for key in tier.files:
                tier.fsync(key)
        durable_save(record.as_dict(), self.folder / STATE)

    # --- a step ---

    def commit(self, record: StepRecord, grad_keys: list[str]) -> None:
        """The gradient log flushed, then the commit record written (steps 1-2)."""
        for key in grad_keys:
            self.grads.fsync(key)
        fail_point("before-commit", record.step)
        (self.folder / APPLIED).unlink(missing_ok=True)
        durable_save(record.as_dict(), self.folder / COMMIT)
        self.record = record

    def write_unit(self, p_key: str, p: torch.Tensor, state: dict[str, tuple[str, torch.Tensor]], index: int) -> None:
        """A unit's new parameters and moments (`state`: name -> (key, tensor)) staged, recorded applied, renamed in."""
        self.params.stage(p_key, p)
        for key, t in state.values():
            self.optimizer.stage(key, t)
        self.mark_applied(index)
        self.params.commit_staged(p_key)
        for key, _ in state.values():
            self.optimizer.commit_staged(key)

    def mark_applied(self, index: int) -> None:
        with self.lock:
            with open(self.folder / APPLIED, "a") as f:
                f.write(f"{index}\n")
                f.flush()
                os.fsync(f.fileno())
            if self.record is not None and len(self.applied()) == 1:
                fail_point("mid-apply", self.record.step)

    def applied(self) -> set[int]:
        path = self.folder / APPLIED
        lines = path.read_text().split("\n") if path.is_file() else []
        return {int(x) for x in lines[:-1] if x.strip()}  # a torn last line (no newline) was never recorded

    def complete(self) -> None:
        """Every owed unit applied: the step is the scratch's (step 4)."""
        record = self.record
        if record is None:
            raise RuntimeError("no committed step to complete")
        durable_save({**record.as_dict(), "lr": 0.0, "coef": 1.0, "units": []}, self.folder / STATE)
        (self.folder / COMMIT).unlink(missing_ok=True)
        (self.folder / APPLIED).unlink(missing_ok=True)
        self.record = None

    # --- recovery ---

    def committed_step(self) -> int:
        """The newest step this rank committed (its commit record's, else its completed state's)."""
        newest = read_record(self.folder / COMMIT) or read_record(self.folder / STATE)
        if newest is None:
            raise BehemothError(f"{self.folder} holds no journal ({STATE})", "resume a run trained with offload.commit=journal, or start anew")
        return newest.step

    def pending(self, group: dist.ProcessGroup | None, device: torch.device) -> StepRecord | None:
        """The committed step still to apply, agreed by every rank of `group`; a commit only this rank made is discarded."""
        mine = self.committed_step()
        agreed = torch.tensor([mine], dtype=torch.int64, device=device)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        record = read_record(self.folder / COMMIT)
        if record is None:
            return None
        if record.step > int(agreed):  # another rank never committed it: nothing of it was applied anywhere
            (self.folder / COMMIT).unlink()
            (self.folder / APPLIED).unlink(missing_ok=True)
            return None
        self.record = record
        return record

    def finish_applied(self, p_key: str, state_keys: list[str]) -> None:
        """A unit recorded applied: its renames done (again, where the kill came first)."""
        self.params.commit_staged(p_key)
        for key in state_keys:
            self.optimizer.commit_staged(key)

    def discard_staged(self, p_key: str, state_keys: list[str]) -> None:
        """A unit not recorded applied: its old files stand; what was staged for it is dropped."""
        self.params.discard_staged(p_key)
        for key in state_keys:
            self.optimizer.discard_staged(key)

    def last_state(self) -> StepRecord:
        record = read_record(self.folder / STATE)
        if record is None:
            raise BehemothError(f"{self.folder} holds no journal ({STATE})", "resume a run trained with offload.commit=journal, or start anew")
        return record
