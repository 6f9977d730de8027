"""Which trial runs next, to which step: every trial to its end, or successive halving on validation loss.

Successive halving (Jamieson & Talwalkar; asynchronous: ASHA, Li et al. 2020) runs trials rung by rung: rung k ends at
min_steps * eta**k steps (the last rung at train.steps), and the best 1/eta of the trials that reached a rung continue,
from their checkpoints, to the next. `sha` decides a rung once every trial that can reach it has; `asha` promotes a
trial as soon as it is in the top 1/eta of its rung so far (a free slot is never left waiting for a rung to fill).
Once no trial can still reach a rung, both keep at least one trial going from it, so a finite sweep ends with a winner
trained to train.steps. A policy is pure bookkeeping: the runner tells it what finished; it says what runs next.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from behemoth.errors import BehemothError
from behemoth.sweep.spec import PruneSpec


def rung_steps(min_steps: int, eta: int, steps: int) -> list[int]:
    """The step counts at which trials are compared: min_steps, min_steps * eta, ... and finally `steps`."""
    if min_steps >= steps:
        raise BehemothError(f"prune.min_steps={min_steps} is not below train.steps={steps}", f"set prune.min_steps below {steps}")
    out, step = [], min_steps
    while step < steps:
        out.append(step)
        step *= eta
    return [*out, steps]


@dataclass
class Policy:
    """Runs every trial once, to its end: the policy of a sweep without pruning."""

    trials: list[str]
    steps: dict[str, int]  # trial -> its train.steps
    running: dict[str, int] = field(default_factory=dict)  # trial -> the step its segment runs to
    results: dict[str, dict[int, float]] = field(default_factory=dict)  # trial -> step -> validation loss
    failed: set[str] = field(default_factory=set)

    def first_target(self, trial: str) -> int:
        return self.steps[trial]

    def pending(self) -> list[str]:
        return [t for t in self.trials if t not in self.results and t not in self.running and t not in self.failed]

    def next_job(self) -> tuple[str, int] | None:
        """The next segment to run, (trial, step), or None while nothing can start."""
        waiting = self.pending()
        if not waiting:
            return None
        self.running[waiting[0]] = self.first_target(waiting[0])
        return waiting[0], self.first_target(waiting[0])

    def report(self, trial: str, step: int, val_loss: float) -> None:
        """A segment of `trial` ended at `step` with this validation loss (also used to replay a sweep's log)."""
        self.running.pop(trial, None)
        self.results.setdefault(trial, {})[step] = val_loss

    def fail(self, trial: str) -> None:
        self.running.pop(trial, None)
        self.failed.add(trial)

    def reached(self, trial: str) -> int:
        """The largest step `trial` has finished a segment at (0: none)."""
        return max(self.results.get(trial, {0: 0.0}))

    def status(self, trial: str) -> str:
        """failed, running, done (trained to train.steps), stopped (pruned), waiting (a rung not yet decided) or pending."""
        if trial in self.failed:
            return "failed"
        if trial in self.running:
            return "running"
        if self.reached(trial) >= self.steps[trial]:
            return "done"
        if trial not in self.results:
            return "pending"
        return "stopped" if self.is_stopped(trial) else "waiting"

    def is_stopped(self, trial: str) -> bool:
        return False

    def finished(self) -> bool:
        return not self.running and self.next_job_preview() is None

    def next_job_preview(self) -> tuple[str, int] | None:
        waiting = self.pending()
        return (waiting[0], self.first_target(waiting[0])) if waiting else None


@dataclass
class Halving(Policy):
    """Successive halving over `rungs` with reduction factor `eta`, asynchronous (`asha`) or synchronous (`sha`)."""

    min_steps: int = 1
    eta: int = 3
    method: str = "asha"
    promoted: dict[int, set[str]] = field(default_factory=dict)  # rung index -> trials sent on from it

    @property
    def rungs(self) -> list[int]:
        return rung_steps(self.min_steps, self.eta, max(self.steps.values()))

    def first_target(self, trial: str) -> int:
        return self.rungs[0]

    def ranked(self, k: int) -> list[str]:
        """The trials that finished rung k (and did not fail), best validation loss first."""
        step = self.rungs[k]
        done = [t for t, r in self.results.items() if step in r and t not in self.failed]
        return sorted(done, key=lambda t: (self.results[t][step], self.trials.index(t)))

    def decisions(self) -> list[tuple[int, list[str], bool]]:
        """For each rung but the last: (k, the trials in its top quota, whether the rung is closed: no trial can still reach it)."""
        out = []
        closed = not self.pending() and not any(s == self.rungs[0] for s in self.running.values())
        for k in range(len(self.rungs) - 1):
            ranked = self.ranked(k)
            quota = max(1, len(ranked) // self.eta) if closed and ranked else len(ranked) // self.eta
            top = ranked[:quota] if (closed or self.method == "asha") else []
            out.append((k, top, closed))
            promotable = [t for t in top if t not in self.promoted.get(k, set())]
            closed = closed and not promotable and not any(s == self.rungs[k + 1] for s in self.running.values())
        return out

    def next_job_preview(self) -> tuple[str, int] | None:
        for k, top, _ in reversed(self.decisions()):  # the highest rung first: finish the best trials soonest
            for trial in top:
                if trial not in self.promoted.get(k, set()) and trial not in self.running:
                    return trial, self.rungs[k + 1]
        return super().next_job_preview()

    def next_job(self) -> tuple[str, int] | None:
        job = self.next_job_preview()
        if job is None:
            return None
        trial, step = job
        k = self.rungs.index(step)
        if k > 0:
            self.promoted.setdefault(k - 1, set()).add(trial)
        self.running[trial] = step
        return job

    def is_stopped(self, trial: str) -> bool:
        """Pruned: the rung it last reached is closed and it is not among those sent on."""
        k = self.rungs.index(self.reached(trial))
        _, top, closed = self.decisions()[k]
        return closed and trial not in top

    def replay_promotions(self) -> None:
        """After a resumed sweep's results are replayed: a trial with a result at rung k+1 was promoted from rung k."""
        for trial, results in self.results.items():
            for k, step in enumerate(self.rungs[1:]):
                if step in results:
                    self.promoted.setdefault(k, set()).add(trial)


def make_policy(trials: list[str], steps: dict[str, int], prune: PruneSpec | None) -> Policy:
    """The policy a sweep file asks for: every trial to its end, or successive halving (`prune:`) over trials of one length."""
    if prune is None:
        return Policy(trials, steps)
    if len(set(steps.values())) > 1:
        lengths = ", ".join(f"{t} {n}" for t, n in steps.items())
        raise BehemothError(f"prune: needs every trial to have the same train.steps (here: {lengths})", "sweep train.steps without prune:")
    policy = Halving(trials, steps, min_steps=prune.min_steps, eta=prune.reduction_factor, method=prune.method)
    policy.rungs  # noqa: B018 - refuse a min_steps that leaves no rung before the end
    return policy
