"""Measured bubble fraction and per-stage pass times from the executor's timestamps.

The measured bubble uses the simulator's definition, 1 - sum(busy) / (p x span), over the
window the simulator models: from the first action's start on any rank to the end of the last
action before the optimizer step (gradient syncs included, the optimizer step itself not, since
`simulate` gives it no time). `measured_costs` turns the same timestamps into the `Costs` the
simulator takes, so a measured step can be set next to its prediction, and `replayed_bubble` runs the schedule again in the simulator with
every pass taking exactly the time it took, so measured - replayed is what the executor and the
transport cost on top of the passes themselves.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

import torch.distributed as dist

from behemoth.comm import gather_object
from behemoth.parallel.pipeline.analysis.simulate import Costs, _Run
from behemoth.parallel.pipeline.executor import StepTrace
from behemoth.parallel.pipeline.schedules import COMPUTE, Kind, Schedule


@dataclass(frozen=True)
class TimedAction:
    """A picklable record of one executed action."""

    kind: Kind
    stage: int
    microbatch: int
    start: float
    end: float


def timed_actions(trace: StepTrace) -> list[TimedAction]:
    return [TimedAction(t.action.kind, t.action.stage, t.action.microbatch, t.start, t.end) for t in trace.times]


def gather_timelines(trace: StepTrace, group: dist.ProcessGroup) -> list[list[TimedAction]]:
    """Every pipeline rank's timeline of this step, in rank order (on every rank)."""
    return gather_object(timed_actions(trace), group)


def _window(timeline: list[TimedAction]) -> list[TimedAction]:
    return [t for t in timeline if t.kind is not Kind.OPT_STEP]


def measured_bubble(timelines: list[list[TimedAction]]) -> float:
    """1 - busy / (ranks x span) over all ranks, the optimizer step left out."""
    windows = [_window(t) for t in timelines]
    start = min(w[0].start for w in windows if w)
    end = max(w[-1].end for w in windows if w)
    busy = sum(t.end - t.start for w in windows for t in w if t.kind in COMPUTE)
    return 1.0 - busy / (len(timelines) * (end - start))


def measured_costs(timelines_per_step: list[list[list[TimedAction]]], schedule: Schedule, p2p: float = 0.0) -> Costs:
    """Median per-stage F, B (or BI and W) and GRAD_SYNC times over steps, as simulator costs."""
    by: dict[tuple[Kind, int], list[float]] = defaultdict(list)
    for timelines in timelines_per_step:
        for timeline in timelines:
            for t in timeline:
                if t.kind in COMPUTE or t.kind is Kind.GRAD_SYNC:
                    by[(t.kind, t.stage)].append(t.end - t.start)
    stages = range(schedule.num_stages)
    med = lambda kind: [statistics.median(by[(kind, s)]) if by[(kind, s)] else 0.0 for s in stages]  # noqa: E731
    syncs = [d for (kind, _), ds in by.items() if kind is Kind.GRAD_SYNC for d in ds]
    grad_sync = statistics.median(syncs) if syncs else 0.0
    if schedule.split_backward:
        return Costs(med(Kind.FORWARD), med(Kind.BACKWARD_INPUT), med(Kind.BACKWARD_WEIGHT), p2p, grad_sync)
    return Costs(med(Kind.FORWARD), med(Kind.BACKWARD), [0.0] * schedule.num_stages, p2p, grad_sync)


def replayed_bubble(timelines: list[list[TimedAction]], schedule: Schedule, p2p: float = 0.0) -> float:
    """The simulator's bubble when every pass takes exactly its measured time (a gradient sync: the shorter
    of its two replicas' times, the other having waited for it), with `p2p` per message."""
    took: dict[tuple[Kind, int, int], float] = {}
    for timeline in timelines:
        for t in timeline:
            key = (t.kind, t.stage, t.microbatch)
            if t.kind in COMPUTE:
                took[key] = t.end - t.start
            elif t.kind is Kind.GRAD_SYNC:
                took[key] = min(took.get(key, float("inf")), t.end - t.start)
    replay = _Run(schedule, lambda a: took.get((a.kind, a.stage, a.microbatch), 0.0), p2p).run()
    step = max(row[-1].end for row in replay if row)
    busy = sum(i.end - i.start for row in replay for i in row if i.action.kind in COMPUTE)
    return 1.0 - busy / (schedule.ranks * step)
