"""Simulated execution of a pipeline schedule: step time, bubble fraction and stashed activations.

bubble_fraction = idle / total over all ranks = 1 - sum_r busy_r / (p * step_time), where busy_r is
the time rank r spends in compute passes. With uniform per-stage costs and zero p2p the simulator
reproduces the published closed forms exactly (`closed_form_bubble` states each one's accounting).

Execution model (shared with the validator's deadlock check and the grid printer):
- each rank runs its actions in order, one at a time, starting at time 0;
- a compute action (F, B, BI, W, R) occupies its rank for its cost; B costs `backward + weight`, a recomputation
  R its forward's;
- a SEND costs its rank nothing (non-blocking, buffered) and its message arrives `p2p` later;
- a RECV takes no time but blocks until its message has arrived;
- a GRAD_SYNC is a blocking collective of the two ranks holding a stage: it starts when both have
  reached it and occupies both for `grad_sync`; OPT_STEP takes no time.
The resulting times do not depend on the order in which ranks are advanced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from behemoth.parallel.pipeline.schedules import COMPUTE, RECVS, SENDS, Action, Kind, Schedule, ScheduleError

PerStage = float | Sequence[float]


@dataclass(frozen=True)
class Costs:
    """Per-stage pass times (a number for every stage, or one per stage) and communication costs."""

    forward: PerStage = 1.0
    backward: PerStage = 1.0  # input-gradient pass; a full backward costs backward + weight
    weight: PerStage = 1.0  # weight-gradient pass
    p2p: float = 0.0  # latency of one point-to-point message
    grad_sync: float = 0.0  # Chimera's all-reduce of one stage's gradients between its two replicas

    def of(self, action: Action) -> float:
        """Time `action` occupies its rank."""
        pick = lambda v: float(v) if isinstance(v, (int, float)) else float(v[action.stage])  # noqa: E731
        if action.kind in (Kind.FORWARD, Kind.RECOMPUTE):
            return pick(self.forward)
        if action.kind is Kind.BACKWARD:
            return pick(self.backward) + pick(self.weight)
        if action.kind is Kind.BACKWARD_INPUT:
            return pick(self.backward)
        if action.kind is Kind.BACKWARD_WEIGHT:
            return pick(self.weight)
        return self.grad_sync if action.kind is Kind.GRAD_SYNC else 0.0


def unit_slot(action: Action) -> float:
    """Unit slots, the grid of the papers' figures: every compute pass (F, B, BI or W) one time unit, all else free."""
    return 1.0 if action.kind in COMPUTE else 0.0


@dataclass(frozen=True)
class Interval:
    """One executed action: where it ran and when."""

    rank: int
    index: int
    action: Action
    start: float
    end: float


class _Run:
    """State of a timeline run: per-rank clocks and cursors, messages in flight, sync arrivals."""

    def __init__(self, schedule: Schedule, cost: Callable[[Action], float], p2p: float) -> None:
        self.schedule, self.cost, self.p2p = schedule, cost, p2p
        self.clock = [0.0] * schedule.ranks
        self.cursor = [0] * schedule.ranks
        self.timeline: list[list[Interval]] = [[] for _ in range(schedule.ranks)]
        self.arrivals: dict[tuple, float] = {}  # (payload, stage, mb, src, dst) -> arrival time
        self.sync_ready: dict[tuple[int, int], float] = {}  # (stage, rank) -> time the rank reached the sync
        self.sync_done: dict[tuple[int, int], float] = {}  # (stage, rank) -> end of the finished sync

    def step(self, rank: int) -> bool:
        """Run `rank`'s next action if it can start; False when it must wait for another rank."""
        a = self.schedule.per_rank[rank][self.cursor[rank]]
        start = self.clock[rank]
        if a.kind in SENDS:
            self.arrivals[(SENDS[a.kind], a.stage, a.microbatch, rank, a.peer)] = start + self.p2p
        elif a.kind in RECVS:
            key = (a.kind, a.stage, a.microbatch, a.peer, rank)
            if key not in self.arrivals:
                return False
            start = max(start, self.arrivals[key])
        elif a.kind is Kind.GRAD_SYNC and not self._sync(rank, a):
            return False
        elif a.kind is Kind.GRAD_SYNC:
            start = self.sync_done[(a.stage, rank)] - self.cost(a)
        end = start + self.cost(a)
        self.timeline[rank].append(Interval(rank, self.cursor[rank], a, start, end))
        self.clock[rank], self.cursor[rank] = end, self.cursor[rank] + 1
        return True

    def _sync(self, rank: int, a: Action) -> bool:
        """Rendezvous of the two replicas of `a.stage`; True once both have arrived."""
        self.sync_ready.setdefault((a.stage, rank), self.clock[rank])
        peer_key = (a.stage, a.peer)
        if (a.stage, rank) not in self.sync_done and peer_key in self.sync_ready:
            end = max(self.sync_ready[peer_key], self.clock[rank]) + self.cost(a)
            self.sync_done[(a.stage, rank)] = self.sync_done[peer_key] = end
        return (a.stage, rank) in self.sync_done

    def run(self) -> list[list[Interval]]:
        """Advance every rank until all finish; raise ScheduleError naming the stuck ranks on deadlock."""
        lengths = [len(actions) for actions in self.schedule.per_rank]
        progress = True
        while progress:
            progress = False
            for rank in range(self.schedule.ranks):
                while self.cursor[rank] < lengths[rank] and self.step(rank):
                    progress = True
        stuck = [r for r in range(self.schedule.ranks) if self.cursor[r] < lengths[r]]
        if stuck:
            waits = "; ".join(f"rank {r} waits at action {self.cursor[r]} {self.schedule.per_rank[r][self.cursor[r]]}" for r in stuck)
            raise ScheduleError(f"schedule {self.schedule.name} deadlocks: {waits}", "reorder the sends before the receives they unblock")
        return self.timeline


def run_timeline(schedule: Schedule, costs: Costs | None = None) -> list[list[Interval]]:
    """Every action's start and end under `costs` (None: unit slots, zero p2p), per rank; ScheduleError on deadlock."""
    return _Run(schedule, unit_slot, 0.0).run() if costs is None else _Run(schedule, costs.of, costs.p2p).run()


@dataclass(frozen=True)
class SimResult:
    """What a schedule costs: step time, compute per rank, bubble fraction, peak stash per rank."""

    name: str
    step_time: float
    busy: tuple[float, ...]
    bubble_fraction: float
    peak_stash: tuple[int, ...]
    timeline: list[list[Interval]]


def peak_stash(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most micro-batch activations held at once.

    A forward's activations are stashed until the backward pass frees its graph: its B, or for split
    schedules its input-gradient pass BI (the weight pass then needs only the deferred linear layers'
    inputs and output gradients, parallel/deferred.py) — except on stage 0, whose input pass does
    nothing and whose W is the whole backward. A forward that a recomputation R repeats keeps only its input
    (counted as nothing): its activations are held from R to the backward. Counted per (stage, microbatch), so with interleaving one
    unit is one chunk's activations, 1/v of a full pipeline stage's. The count follows from the action
    order alone, not from timing.
    """
    return tuple(max((held for held, _, _ in profile), default=0) for profile in stash_profile(schedule))


def stash_profile(schedule: Schedule) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """Per rank, after each action: (stashed activations, deferred weight passes, kept inputs), counted per (stage,
    micro-batch) as `peak_stash` counts the first: a split backward's BI leaves its W pending (the deferred layers'
    inputs and output gradients held) until the W; a forward that R repeats keeps its input from F to R."""

    def releases(a: Action) -> bool:
        if not schedule.split_backward or a.kind is Kind.BACKWARD:  # DualPipeV mixes full and split backwards
            return a.kind is Kind.BACKWARD
        return a.kind is (Kind.BACKWARD_WEIGHT if a.stage == 0 else Kind.BACKWARD_INPUT)

    out = []
    for actions in schedule.per_rank:
        again = {(a.stage, a.microbatch) for a in actions if a.kind is Kind.RECOMPUTE}
        held = pending = kept = 0
        profile = []
        for a in actions:
            holds = a.kind is Kind.RECOMPUTE or (a.kind is Kind.FORWARD and (a.stage, a.microbatch) not in again)
            held += holds - releases(a)
            split = schedule.split_backward and a.stage != 0
            pending += split and a.kind is Kind.BACKWARD_INPUT
            pending -= split and a.kind is Kind.BACKWARD_WEIGHT
            kept += (a.kind is Kind.FORWARD and (a.stage, a.microbatch) in again) - (a.kind is Kind.RECOMPUTE)
            profile.append((held, pending, kept))
        out.append(tuple(profile))
    return tuple(out)


def simulate(schedule: Schedule, costs: Costs = Costs()) -> SimResult:
    """Time `schedule` under `costs`.

    step_time: when the last rank finishes its last action (optimizer step included).
    busy[r]: the time rank r spends in compute passes (F, B, BI, W); waits, p2p and GRAD_SYNC are not busy.
    bubble_fraction: idle over total across ranks, 1 - sum(busy) / (p * step_time). For GPipe and
    1F1B with uniform costs this is the published (p-1)/(m+p-1); see `closed_form_bubble`.
    """
    for field in ("forward", "backward", "weight"):
        value = getattr(costs, field)
        if not isinstance(value, (int, float)) and len(value) != schedule.num_stages:
            raise ScheduleError(
                f"costs.{field} has {len(value)} per-stage values for {schedule.num_stages} stages",
                f"give one number, or one per stage ({schedule.num_stages})",
            )
    timeline = run_timeline(schedule, costs)
    step = max((row[-1].end for row in timeline if row), default=0.0)
    busy = tuple(sum(i.end - i.start for i in row if i.action.kind in COMPUTE) for row in timeline)
    bubble = 1.0 - sum(busy) / (schedule.ranks * step) if step > 0 else 0.0
    return SimResult(schedule.name, step, busy, bubble, peak_stash(schedule), timeline)


@dataclass(frozen=True)
class ClosedForm:
    """A schedule's published bubble fraction, and whether the simulator must reproduce it exactly for these costs."""

    bubble_fraction: float
    formula: str
    exact: bool  # True when the costs meet the formula's assumptions
    assumption: str


def _uniform(value: PerStage) -> float | None:
    """The common value of a per-stage cost, or None when stages differ."""
    values = {float(value)} if isinstance(value, (int, float)) else {float(v) for v in value}
    return values.pop() if len(values) == 1 else None


def closed_form_bubble(name: str, p: int, m: int, v: int = 1, costs: Costs = Costs()) -> ClosedForm:
    """The published bubble fraction (idle / total, as `simulate` reports it) of schedule `name`.

    gpipe, 1f1b: (p-1)/(m+p-1) for any uniform tF, tB, tW (each rank idles (p-1)(tF+tB+tW)).
    interleaved: (p-1)/(v*m+p-1). Megatron-LM's accounting: with tF, tB the forward and full backward of
        a rank's whole share (v chunks, each costing 1/v of it, as `costs` gives per chunk stage),
        bubble time (p-1)/v * (tF+tB) against ideal time m*(tF+tB); its paper quotes the ratio
        bubble/ideal = (p-1)/(v*m); as a fraction of the step that is (p-1)/(v*m+p-1).
    zb-h1: Qi et al. 2023: bubble time (p-1)(tF+tB-tW) against ideal m(tF+tB+tW), tB the input-gradient
        pass and tW the weight-gradient pass; with tF=tB=tW that is (p-1)/(3m+p-1), a third of 1F1B's
        bubble time. Exact for m >= p and tW <= tF (checked); for m < p the pipeline never fills and
        this construction takes (2m+2p-1) units at tF=tB=tW=1 (not a published form; not marked exact).
    chimera: Li & Hoefler 2021, D = p stages, N = m micro-batches per step (N/2 per pipeline, N a
        multiple of D): (D-2)/(2N+D-2), counting the forward and the full backward of a micro-batch as
        one equal slot each (tF = tB + tW), as the paper's figures do: D-2 idle slots per rank against
        2N busy ones. With backward = 2 x forward the ratio is larger (D=4, N=4: 0.25, not 0.2).
    zbv, dualpipev: 2p stages in a V, costs per chunk (half a rank's share): with tF = tB = tW = t a step takes
        (6m+p-1)t, so the bubble is (p-1)/(6m+p-1): the only idle time is the p-1 chunk slots the first forward takes to
        reach the last rank, the least any schedule can have; the zero-bubble paper's (p-1)(tF+tB-2tW) = 0 counts the
        rest. Exact for m >= 2p-1 (ZBV) and m >= 2p (DualPipeV, its minimum); unequal passes leave more (simulate).
    1f1b-scp: with forward f <= full backward B = tB+tW and R = f, a step takes m(2f+B) + (p-1)(f+B) - 3f for m >= max(p, 3):
        1F1B with recomputation inside the backward takes (m+p-1)(2f+B). The busy time counts each rank's
        recomputations (rank r < p-1 recomputes all but its last micro-batch), so the fraction is of that work.
    All assume uniform costs over stages, zero p2p latency and (Chimera) free gradient syncs.
    """
    tf, tb, tw = _uniform(costs.forward), _uniform(costs.backward), _uniform(costs.weight)
    uniform = None not in (tf, tb, tw) and costs.p2p == 0
    base = "uniform per-stage costs and zero p2p"
    if name in ("gpipe", "1f1b"):
        return ClosedForm((p - 1) / (m + p - 1), "(p-1)/(m+p-1)", uniform, base)
    if name == "interleaved":
        return ClosedForm((p - 1) / (v * m + p - 1), "(p-1)/(vm+p-1)", uniform, base)
    if name == "zb-h1":
        tf, tb, tw = (tf, tb, tw) if uniform else (1.0, 1.0, 1.0)
        bubble, ideal = (p - 1) * (tf + tb - tw), m * (tf + tb + tw)
        formula = "(p-1)/(3m+p-1)" if tf == tb == tw else "x/(m(F+B+W)+x)"
        return ClosedForm(bubble / (ideal + bubble), formula, uniform and m >= p and tw <= tf, base + ", m >= p and tW <= tF; x = (p-1)(tF+tB-tW)")
    if name == "chimera":
        equal = uniform and costs.grad_sync == 0 and abs(tf - (tb + tw)) <= 1e-12 * tf
        return ClosedForm(
            (p - 2) / (2 * m + p - 2),
            "(D-2)/(2N+D-2)",
            equal and m % p == 0,
            base + ", free grad sync, forward = full backward (tF = tB + tW), N a multiple of D",
        )
    if name in ("zbv", "dualpipev"):
        equal = uniform and tf == tb == tw
        return ClosedForm((p - 1) / (6 * m + p - 1), "(p-1)/(6m+p-1)", equal and m >= 2 * p - 1, base + ", tF = tB = tW per chunk, m >= 2p-1")
    if name == "1f1b-scp":
        return _scp_closed_form(p, m, tf, tb, tw, uniform)
    raise ScheduleError(f"schedule={name!r} has no closed form", "use one of gpipe, 1f1b, interleaved, zb-h1, chimera, zbv, dualpipev, 1f1b-scp")


def _scp_closed_form(p: int, m: int, tf: float | None, tb: float | None, tw: float | None, uniform: bool) -> ClosedForm:
    """1F1B-SCP's bubble: step m(2f+B) + (p-1)(f+B) - 3f against busy p*m(f+B) plus f per recomputation (B = tB + tW)."""
    f, b = (tf, tb + tw) if uniform else (1.0, 2.0)
    recomputes = (p - 1) * (m - 1)
    step = m * (f + b) if p == 1 else m * (2 * f + b) + (p - 1) * (f + b) - 3 * f
    busy = p * m * (f + b) + recomputes * f
    exact = uniform and f <= b and (p == 1 or m >= max(p, 3))
    return ClosedForm(1 - busy / (p * step), "1-busy/(p*step)", exact, "uniform per-stage costs and zero p2p, tF <= tB + tW, m >= max(p, 3)")
