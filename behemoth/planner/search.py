"""The search: every layout of a world that can work, priced, ranked, checked by `problems()`, the best simulated.

Enumeration runs over the degrees (tp within a node and dividing every width it splits, pp up to the depth, dp what
remains and divides the batch), the micro-batch size (and so the count), the schedule (interleaved with each chunk
count, zb-h1, Chimera where it can run), the ZeRO stage and sequence parallelism; the options a user pins
(`parallel.tp=2` on the command line) are not varied. Stage boundaries and recomputation are chosen per layout by
stages.py. The priced layouts are ranked by step time; `problems()` — the function the runtime refuses with — is then
asked about each, best first, until enough plans pass; those are priced again with the schedule simulator and
ranked anew. Enumeration beats a solver here: the space is a few thousand layouts even for 3,072 devices, each
priced in closed form, and the one combinatorial part (stage boundaries) has a bisection solution.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from behemoth.planner.cluster import ClusterSpec
from behemoth.planner.cost import PlanCost, planned_bounds, price, price_ranking, simulable
from behemoth.planner.footprint import stage_memory, state_bytes
from behemoth.planner.layout import SCHEDULES, Layout, Workload
from behemoth.planner.stages import SINGLE_STAGE_SCHEDULES, cut_stages, stage_models
from behemoth.planner.steptime import step_floor


@dataclass(frozen=True)
class Space:
    """What the search may vary; a tuple pins a dimension to those values."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    zero: tuple[int, ...] = (0, 1, 2, 3)
    sp: tuple[bool, ...] = (False, True)
    schedules: tuple[str, ...] = tuple(s for s in SCHEDULES if s != "gpipe")  # gpipe: 1F1B's step, more memory
    chunks: tuple[int, ...] = (2, 4)
    micro_batch: tuple[int, ...] | None = None
    recompute: bool = True
    max_tp: int | None = None  # default: the devices of one node


@dataclass
class SearchResult:
    """The ranked plans that fit, the closest ones that do not, and what the search did."""

    ranked: list[PlanCost]
    unfit: list[PlanCost]
    layouts: int
    priced: int
    refused: list[tuple[Layout, list[Any]]] = field(default_factory=list)
    seconds: float = 0.0


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def allowed(values: tuple[int, ...] | None, candidates: list[int]) -> list[int]:
    return [c for c in candidates if values is None or c in values]


def tp_degrees(work: Workload, world: int, space: Space, cluster: ClusterSpec) -> list[int]:
    """Tensor-parallel degrees that divide the world and every width they split, within one node unless pinned."""
    sizes = work.census.shape.tensor_parallel_sizes().values()
    cap = space.max_tp or cluster.devices_per_node
    return [t for t in allowed(space.tp, divisors(world)) if all(s % t == 0 for s in sizes) and (space.tp is not None or t <= cap)]


def schedules_for(pp: int, m: int, n_layer: int, space: Space) -> list[tuple[str, int]]:
    """(schedule, chunks) pairs that can run pp stages and m micro-batches over n_layer blocks."""
    if pp == 1:
        return [("1f1b", 1)]
    out = [(s, 1) for s in ("1f1b", "gpipe", "zb-h1") if s in space.schedules]
    if "interleaved" in space.schedules and m % pp == 0:
        out += [("interleaved", v) for v in space.chunks if pp * v <= n_layer]
    if "chimera" in space.schedules and pp % 2 == 0 and m % pp == 0:
        out.append(("chimera", 1))
    return out


def enumerate_layouts(work: Workload, world: int, space: Space, cluster: ClusterSpec) -> list[Layout]:
    """Every layout of `world` processes the space allows (before boundaries and recomputation are chosen)."""
    shape, batch = work.census.shape, work.global_batch
    out = []
    for tp in tp_degrees(work, world, space, cluster):
        for pp in allowed(space.pp, [p for p in divisors(world // tp) if p <= shape.n_layer]):
            dp = world // (tp * pp)
            if (space.dp is not None and dp not in space.dp) or batch % dp:
                continue
            for mb in allowed(space.micro_batch, divisors(batch // dp)):
                m = batch // (dp * mb)
                for schedule, v in schedules_for(pp, m, shape.n_layer, space):
                    for zero in space.zero:
                        if (zero == 3 and pp > 1) or (zero == 2 and schedule == "chimera") or (zero == 0 and work.param_dtype != "fp32"):
                            continue
                        for sp in sorted({s and tp > 1 for s in space.sp}):
                            if sp and work.seq_len % tp:
                                continue
                            out.append(Layout(dp, tp, pp, zero, sp, mb, m, schedule, v))
    return out


def fit_layout(work: Workload, lay: Layout, cluster: ClusterSpec, space: Space) -> PlanCost:
    """`lay` with its stage boundaries and recomputing ranks chosen, priced (it may still not fit)."""
    limit = cluster.device.usable_bytes
    if lay.pp == 1:
        plain = price(work, lay, cluster)
        if plain.fits or not space.recompute:
            return plain
        return price(work, lay.but(recompute=(0,)), cluster)
    if lay.schedule in SINGLE_STAGE_SCHEDULES:
        cut = cut_stages(stage_models(work, lay, cluster, allow_recompute=space.recompute), work.census.shape.n_layer, limit)
        if cut is not None:
            return price(work, lay.but(boundaries=cut[0], recompute=cut[1]), cluster, every_rank=False)
    bounds = planned_bounds(work, lay)
    plain = lay.but(boundaries=bounds)
    over = [r for r in range(lay.pp) if stage_memory(work, plain, r, [(s, bounds[s + 1] - bounds[s]) for s in plain.held_stages(r)]).peak > limit]
    return price(work, plain.but(recompute=tuple(over)) if over and space.recompute else plain, cluster, every_rank=False)


def memory_floor(work: Workload, lay: Layout) -> float:
    """A lower bound of the busiest rank's memory: the model states of an even share of the parameters."""
    share = work.census.at(lay.tp, lay.ep)
    mean = (work.census.shape.n_layer * share.block + share.embed + share.head) / lay.pp
    return sum(state_bytes(int(mean), lay, work))


def search(
    work: Workload, cluster: ClusterSpec, world: int, space: Space = Space(), *, cfg: Any = None, top: int = 8, exact: int = 4
) -> SearchResult:
    """Rank the layouts of `world` processes for `work` on `cluster` (see the module docstring); `cfg`: the config whose
    plan the layouts replace, for `problems()`. Branch and bound: layouts are priced in the order of their time floor,
    and the search stops once the floor exceeds the `top`-th best plan found."""
    t0 = time.perf_counter()
    cluster = cluster.with_nodes(world)
    limit = cluster.device.usable_bytes
    layouts = enumerate_layouts(work, world, space, cluster)
    floors = sorted(((step_floor(work, lay, cluster), i) for i, lay in enumerate(layouts) if memory_floor(work, layouts[i]) <= limit))
    ranked: list[PlanCost] = []
    unfit: list[PlanCost] = []
    refused: list[tuple[Layout, list[Any]]] = []
    priced = 0
    for floor, i in floors:
        if len(ranked) >= top and floor > ranked[-1].step_seconds:
            break
        cost = fit_layout(work, layouts[i], cluster, space)
        priced += 1
        if not cost.fits:
            unfit = sorted(unfit + [cost], key=lambda c: c.peak_memory)[:top]
            continue
        if len(ranked) >= top and rank_key(cost) >= rank_key(ranked[-1]):
            continue
        found = refusals(cfg, cost.layout, world) if cfg is not None else []
        if found:
            refused.append((cost.layout, found))
            continue
        ranked = sorted(ranked + [cost], key=rank_key)[:top]
    if not ranked and not unfit:  # nothing passed the memory floor: price the lightest layouts to say by how much
        unfit = sorted(
            (fit_layout(work, lay, cluster, space) for lay in sorted(layouts, key=lambda l: memory_floor(work, l))[:top]), key=lambda c: c.peak_memory
        )
    ranked = sorted(price_ranking(work, ranked, cluster, simulate=exact > 0), key=rank_key)  # every row by one function
    return SearchResult(ranked, unfit, len(layouts), priced, refused, time.perf_counter() - t0)


def rank_key(cost: PlanCost) -> tuple:
    """Step time, then memory, then the simplest plan (fewer ranks recomputing, lower ZeRO stage)."""
    lay = cost.layout
    return (round(cost.step_seconds, 12), len(lay.recompute), lay.zero, cost.peak_memory, lay.describe())


def simulated(work: Workload, cost: PlanCost, cluster: ClusterSpec) -> PlanCost:
    """The plan priced again with the schedule simulator (pipelines small enough to simulate quickly)."""
    lay = cost.layout
    if lay.pp == 1 or not simulable(lay):
        return cost
    return price(work, lay.but(boundaries=cost.bounds), cluster, exact=True)


def refusals(cfg: Any, lay: Layout, world: int) -> list[Any]:
    """What `problems()` says of the config with this layout's plan (the runtime refuses exactly these)."""
    from behemoth.planner.feasibility import problems

    plan = lay.to_plan(cfg.parallel)
    return problems(cfg.model_copy(update={"parallel": plan, "train": cfg.train.model_copy(update={"micro_batch": None})}), world)
