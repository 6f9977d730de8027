"""A streamed pipeline's data-parallel traffic, as the stage streamer runs it (offload/stage_stream.py).

Each pipeline stage streams its own units, pass by pass (offload/stage_order.py): every stay of a unit (a run of
consecutive visits that need it, `order.plan_residencies`) all-gathers it over the data-parallel group when it
begins, and every stay that computes gradients reduce-scatters the unit's gradient when it ends (offload/executor.py
`Streamer.begin` / `end`), on the main thread, inside the pass: nothing hides it, and nothing like DDP's one
all-reduce of the stage's gradients after its passes runs. Per micro-batch a unit has a forward stay and a backward
stay (under a split backward a later stage's block has a BI stay that gathers and a W stay that gathers again and
reduces); the head's forward, loss and backward are one stay (`FB`); a pass that begins with the unit the previous
pass ended with keeps it (1F1B's backward of the first stage ends on the embedding its next forward starts with).
The stays are counted off the rank's own visit order; a long pipeline's (more than `LISTED_VISITS` visits) by the
closed form without such merges (an upper bound).
"""

from __future__ import annotations

from functools import lru_cache

from behemoth.offload.order import plan_residencies
from behemoth.offload.stage_order import stage_order, stage_units
from behemoth.parallel.pipeline.schedules import build_schedule, schedule_chunks
from behemoth.planner.census import TPShare
from behemoth.planner.cluster import ClusterSpec
from behemoth.planner.layout import Layout, Workload
from behemoth.planner.memory import BYTES_PER_PARAM

SPLIT = ("zb-h1", "zbv", "dualpipev")  # schedules whose backward is an input pass (BI) and a weight pass (W)
LISTED_VISITS = 20_000  # a rank with at most this many unit visits in a step has its stays counted off its order


@lru_cache(maxsize=4096)
def unit_stays(schedule: str, p: int, m: int, v: int, rank: int, bounds: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """(unit, stays, stays that compute gradients) of every unit pipeline rank `rank` streams in a step (order.py's
    numbers: 0 the embedding, L + 1 the head)."""
    visits = stage_order(build_schedule(schedule, p, m, v), rank, stage_units(list(bounds)))
    counts: dict[int, list[int]] = {}
    for stay in plan_residencies(visits, {}).stays:
        c = counts.setdefault(stay.unit, [0, 0])
        c[0] += 1
        c[1] += stay.grads
    return tuple((u, s, g) for u, (s, g) in sorted(counts.items()))


def closed_stays(lay: Layout, bounds: tuple[int, ...], rank: int) -> list[tuple[int, int, int]]:
    """`unit_stays` without merged stays: per micro-batch two of the embedding and of each block (three of a later
    stage's block under a split backward), one of the head; one with gradients each."""
    m, n, out = lay.microbatches, bounds[-1], []
    for s in lay.held_stages(rank):
        split = lay.schedule in SPLIT and s > 0  # a first stage's input pass is empty: its W is the backward
        out += [(0, 2 * m, m)] if s == 0 else []
        out += [(b + 1, (3 if split else 2) * m, m) for b in range(bounds[s], bounds[s + 1])]
        out += [(n + 1, m, m)] if s == lay.stages - 1 else []
    return out


def unit_elements(share: TPShare, unit: int, n_layer: int) -> int:
    """A unit's elements on this tensor-parallel rank (what one gather of it moves, padding aside)."""
    return share.embed if unit == 0 else share.head if unit == n_layer + 1 else share.block


def step_collectives(work: Workload, lay: Layout, bounds: tuple[int, ...], rank: int) -> list[tuple[int, int, int]]:
    """(all-gathers, reduce-scatters, elements) of every unit pipeline rank `rank` streams in a step."""
    v, share = schedule_chunks(lay.schedule, lay.chunks), work.share(lay)
    held = sum(bounds[s + 1] - bounds[s] + 2 for s in lay.held_stages(rank))
    if held * lay.microbatches * 3 <= LISTED_VISITS:
        stays = list(unit_stays(lay.schedule, lay.pp, lay.microbatches, v, rank, bounds))
    else:
        stays = closed_stays(lay, bounds, rank)
    return [(s, g, unit_elements(share, u, bounds[-1])) for u, s, g in stays]


def compute_bytes(lay: Layout, work: Workload) -> int:
    """Bytes of a gathered parameter or gradient element a streamed unit moves (the compute dtype)."""
    return BYTES_PER_PARAM[work.param_dtype][0] if lay.zero else 4


def streamed_traffic_bytes(work: Workload, lay: Layout, bounds: tuple[int, ...], rank: int) -> tuple[float, float]:
    """(bytes all-gathered, bytes reduce-scattered) by pipeline rank `rank` in one step, each at the unit's full size."""
    c, units = compute_bytes(lay, work), step_collectives(work, lay, bounds, rank)
    return float(sum(g * c * n for g, _, n in units)), float(sum(s * c * n for _, s, n in units))


def streamed_dp_seconds(work: Workload, lay: Layout, cluster: ClusterSpec, bounds: tuple[int, ...], rank: int) -> float:
    """Seconds pipeline rank `rank` of a streamed pipeline spends in a step in its units' all-gathers and
    reduce-scatters over the dp x cp x ep ranks that share its shards (tp apart), all exposed (each blocks its pass)."""
    n, c, tp = lay.shard_ranks, compute_bytes(lay, work), lay.tp
    if n == 1:
        return 0.0
    return sum(
        g * cluster.collective("all_gather", c * e, n, tp) + s * cluster.collective("reduce_scatter", c * e, n, tp)
        for g, s, e in step_collectives(work, lay, bounds, rank)
        if e
    )


def streamed_pipeline_dp_seconds(work: Workload, lay: Layout, cluster: ClusterSpec, bounds: tuple[int, ...]) -> float:
    """A streamed pipeline step's data-parallel seconds: its slowest rank's (`streamed_dp_seconds`)."""
    return max(streamed_dp_seconds(work, lay, cluster, bounds, r) for r in range(lay.pp))
