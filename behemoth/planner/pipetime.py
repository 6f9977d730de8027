"""The pipeline: per-stage forward, input-gradient and weight-gradient seconds of one micro-batch turned into a step,
by the schedule simulator (`simulate.py`) for the plans that are reported or a closed form while searching, and the
stage boundaries the pricing assumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from behemoth.models.shape import LayerCosts
from behemoth.parallel.pipeline.analysis.simulate import Costs, simulate
from behemoth.parallel.pipeline.partition import balance_stages
from behemoth.parallel.pipeline.schedules import build_schedule
from behemoth.parallel.pipeline.shifted import recomputed
from behemoth.planner.layout import Layout


@dataclass(frozen=True)
class PassCosts:
    """Seconds of one micro-batch's passes through each model stage, and of the pipeline's messages."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]  # input-gradient pass (a full backward is backward + weight)
    weight: tuple[float, ...]
    p2p: float
    tp_comm: float  # of all passes of one micro-batch through the whole model, included above
    recompute: float  # of all passes of one micro-batch, included above
    context: float = 0.0  # context parallelism's exposed seconds of one micro-batch through one rank's blocks, included above


def uniform_bounds(embed: float, block: float, head: float, n: int, stages: int) -> tuple[int, ...]:
    """Fence posts for `n` equal blocks in `stages` stages (embedding cost on the first, head on the last) that
    minimize the costliest stage, then even out the rest: `balance_stages`'s optimum, found by bisecting the costliest
    stage's cost instead of a dynamic program over every cut (equal blocks make the caps a closed form)."""
    if stages == 1:
        return (0, n)
    extras = [embed] + [0.0] * (stages - 2) + [head]

    def caps(limit: float) -> list[int]:
        return [int((limit - e) / block + 1e-9) for e in extras]

    lo, hi = 0.0, max(extras) + n * block
    while hi - lo > 1e-9 * hi:
        mid = (lo + hi) / 2
        c = caps(mid)
        lo, hi = (lo, mid) if min(c) >= 1 and sum(c) >= n else (mid, hi)
    take = caps(hi)
    while sum(take) > n:
        cost = [t * block + e for t, e in zip(take, extras)]
        i = max((j for j in range(stages) if take[j] > 1), key=lambda j: (cost[j], j))
        take[i] -= 1
    bounds = [0]
    for t in take:
        bounds.append(bounds[-1] + t)
    return tuple(bounds)


@lru_cache(maxsize=256)
def runtime_bounds(costs: LayerCosts, stages: int) -> tuple[int, ...]:
    """The boundaries the runtime chooses for an unset `stage_boundaries` (balance=flops)."""
    return tuple(balance_stages(costs, stages))


SPLIT_SCHEDULES = ("zb-h1", "zbv", "dualpipev")  # a backward split into input-gradient (BI) and weight (W) passes


def streamed_pipeline(lay: Layout) -> bool:
    """Whether each pipeline stage streams its own units (offload/stage_stream.py): a streamed stage keeps each block's
    input and recomputes the block in its backward (a split backward: in its BI and again in its W)."""
    return lay.pp > 1 and lay.offload.streams


def scp_share(lay: Layout, rank: int) -> float:
    """1f1b-scp: the share of a step's micro-batches pipeline rank `rank` recomputes (its schedule's R passes)."""
    return len(recomputed(rank, lay.pp, lay.microbatches)) / lay.microbatches


def pipeline_seconds(lay: Layout, costs: PassCosts, *, exact: bool) -> tuple[float, float]:
    """(step, bubble) seconds of the micro-batches' passes: the simulator when `exact`, else a closed form."""
    per_stage = [f + b + w for f, b, w in zip(costs.forward, costs.backward, costs.weight)]
    m, p = lay.microbatches, lay.pp
    if p == 1:
        busy = m * per_stage[0]
        return busy, 0.0
    per_rank = [sum(per_stage[s] for s in lay.held_stages(r)) for r in range(p)]
    if exact:
        sim = simulate(build_schedule(lay.schedule, p, m, lay.chunks), Costs(costs.forward, costs.backward, costs.weight, p2p=costs.p2p))
        return sim.step_time, sim.step_time - sum(sim.busy) / p
    return closed_form_step(lay, per_rank, costs)


LISTED_SCHEDULES = ("zbv", "dualpipev", "1f1b-scp")  # priced from their own action lists (simulated at uniform costs)
UNIFORM_SIMULATE_LIMIT = 6_000  # actions: a listed pipeline this short is simulated at uniform costs while searching


@lru_cache(maxsize=4096)
def uniform_step(name: str, p: int, m: int, backward: float, weight: float, p2p: float) -> tuple[float, float]:
    """(step, mean busy) of schedule `name`'s action lists simulated with every stage costing forward 1, `backward` and
    `weight` (per model stage) and messages `p2p`: the exact step of uniform stages, in forward units."""
    schedule = build_schedule(name, p, m, 2 if name in ("zbv", "dualpipev") else 1)
    sim = simulate(schedule, Costs(1.0, backward, weight, p2p=p2p))
    return sim.step_time, sum(sim.busy) / p


def listed_step(lay: Layout, per_rank: list[float], costs: PassCosts) -> tuple[float, float]:
    """(step, bubble) of a V-shaped or shifted schedule: its action lists simulated with every stage at the mean
    per-stage forward f, input-gradient b and weight w passes and the p2p latency (exact for uniform stages), plus the
    slowest rank's excess over the mean on every micro-batch. A pipeline of more than 6,000 actions takes a closed form
    read off the same simulations (`closed_listed_step`)."""
    m, p, n = lay.microbatches, lay.pp, len(costs.forward)
    f, b, w = (sum(x) / n for x in (costs.forward, costs.backward, costs.weight))
    excess = m * (max(per_rank) - sum(per_rank) / p)
    if p * m * lay.chunks * 6 > UNIFORM_SIMULATE_LIMIT or f <= 0:
        step, busy = closed_listed_step(lay.schedule, p, m, f, b, w)
        hops = 2 * (p - 1) * costs.p2p
        return step + hops + excess, step + hops - busy + excess
    step, busy = uniform_step(lay.schedule, p, m, b / f, w / f, costs.p2p / f)
    return step * f + excess, (step - busy) * f + excess


def closed_listed_step(name: str, p: int, m: int, f: float, b: float, w: float) -> tuple[float, float]:
    """(step, mean busy) at uniform per-stage passes f, b, w and no p2p latency, in closed form: 1f1b-scp's is
    `closed_form_bubble`'s m(2f+B) + (p-1)(f+B) - 3f (B = b + w; exact for m >= max(p, 3), f <= B), ZBV's and (an
    approximation) DualPipeV's 2m(f+b+w) + (p-1) max(f, b) + (p-2) max(f-b, 0) (exact for m >= 2p-1 and w >= f,
    tests/test_planner_schedules.py)."""
    if name == "1f1b-scp":
        return m * (2 * f + b + w) + (p - 1) * (f + b + w) - 3 * f, m * (f + b + w) + (p - 1) * (m - 1) * f / p
    busy = 2 * m * (f + b + w)
    return busy + (p - 1) * max(f, b) + (p - 2) * max(f - b, 0.0), busy


def listed_floor(lay: Layout, mean: float, forward: float, p2p: float) -> float:
    """A lower bound of `listed_step` for ranks of `mean` work: the last rank's first forward waits for p - 1 forwards."""
    return lay.microbatches * mean + (lay.pp - 1) * forward + 2 * (lay.pp - 1) * p2p


def closed_form_step(lay: Layout, per_rank: list[float], costs: PassCosts) -> tuple[float, float]:
    """The pipeline step without simulation: the slowest rank's work plus the schedule's published bubble."""
    m, p, v = lay.microbatches, lay.pp, lay.chunks
    slowest, mean = max(per_rank), sum(per_rank) / p
    hops = 2 * (p - 1) * costs.p2p
    if lay.schedule in LISTED_SCHEDULES:
        return listed_step(lay, per_rank, costs)
    if lay.schedule == "chimera":
        work = m * slowest / 2
        bubble = (p - 2) / 2 * mean / 2 + hops / 2
    elif lay.schedule == "zb-h1":
        work = m * slowest
        fb_w = [f + b - w for f, b, w in zip(costs.forward, costs.backward, costs.weight)]
        bubble = (p - 1) * sum(fb_w) / len(fb_w) + hops
    else:
        work = m * slowest
        bubble = (p - 1) * mean / v + hops * (1 if lay.schedule != "interleaved" else v)
    return work + bubble, bubble + (slowest - mean) * m
