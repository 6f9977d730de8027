"""The search: every layout of a world that can work, priced, ranked, checked by `problems()`, the best simulated.

Enumeration runs over the degrees (tp within a node and dividing every width it splits, pp up to the depth, ep dividing
every MoE layer's experts, dp what remains and divides the batch), the micro-batch size (and so the count), the schedule
(interleaved with each chunk count, zb-h1, Chimera, the V-shaped zbv and dualpipev and Merak's 1f1b-scp where they can
run), the ZeRO stage and sequence parallelism; the
options a user pins (`parallel.tp=2` on the command line) are not varied. Offload (`OFFLOAD_PLACEMENTS`: the moments in
host memory, then whole ZeRO-3 units on host memory or disk) is searched only when no plan fits the devices: it is always
slower than a plan that fits. A plan fits when its busiest rank stays `margin` (5%) below the device's usable memory:
the memory model is accurate to within that, so a plan closer to the edge is not chosen. Stage boundaries and recomputation are chosen per layout by
stages.py. The priced layouts are ranked by step time; `problems()` — the function the runtime refuses with — is then
asked about each, best first, until enough plans pass; those are priced again with the schedule simulator and
ranked anew. Enumeration beats a solver here: the space is a few thousand layouts even for 3,072 devices, each
priced in closed form, and the one combinatorial part (stage boundaries) has a bisection solution.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

from behemoth.models.causal_lm import has_tp2d_plan
from behemoth.parallel.context.apply import heads_per_rank
from behemoth.parallel.tensor.cube import cube_side
from behemoth.planner.cluster import ClusterSpec
from behemoth.planner.cost import PlanCost, planned_bounds, price, price_ranking, simulable
from behemoth.planner.footprint import placed, stage_memory, state_bytes
from behemoth.planner.layout import CP_MODES, SCHEDULES, Layout, Offload, Workload
from behemoth.planner.stages import SINGLE_STAGE_SCHEDULES, cut_stages, stage_models
from behemoth.planner.steptime import step_floor

TP_MODES = ("1d", "2d", "2.5d", "3d")
MEMORY_MARGIN = 0.05  # the memory model's stated accuracy: a plan's busiest rank stays this share below the usable bytes
OFFLOAD_PLACEMENTS = (  # lightest I/O first: ZeRO-Offload's moments, then ZeRO-3 units on host memory, then on disk
    Offload(optimizer="host", zero_offload=True),
    Offload(optimizer="host"),
    Offload(params="host", grads="host", optimizer="host"),
    Offload(optimizer="disk"),
    Offload(params="disk", grads="disk", optimizer="disk"),
)


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
    ep: tuple[int, ...] | None = None  # default: every degree that divides the experts (1 for a dense model)
    cp: tuple[int, ...] | None = None  # default: every degree up to max_cp where the runtime composes it (cp_degrees)
    cp_modes: tuple[str, ...] = CP_MODES
    max_cp: int | None = None  # default: the devices of one node
    offload: tuple[Offload, ...] | None = None  # pinned placements; default: on the device, OFFLOAD_PLACEMENTS if nothing fits
    margin: float = MEMORY_MARGIN
    tp_modes: tuple[str, ...] = TP_MODES  # 2d, 2.5d, 3d: grids and cubes where `grid_allowed` says the runtime runs one
    max_depth: int = 2  # the deepest 2.5-D Tesseract tried (d grids of q x q)


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


def grid_allowed(work: Workload, tp: int, mode: str = "2d", depth: int = 1) -> bool:
    """Whether a grid or cube of tp ranks can run this model (`tensor2d_problems`, `tensor3d_problems`): a family with a
    2-D (or 3-D) plan (behemoth's GPT, the Llama-layout families of models/hf_families.py), untied, no experts,
    LoRA or dropout; a side q >= 2 (tp = q*q, d*q*q under 2.5-D, q^3 under 3-D), n_head, the KV heads and the vocabulary
    split by q, d_model, the MLP and the key/value widths by q*q (by q^3 on a cube)."""
    shape = work.census.shape
    family = has_tp2d_plan(shape.arch, mode)
    if not family or shape.tied or any(shape.experts) or work.census.lora is not None or work.dropout:
        return False
    q = cube_side(tp) if mode == "3d" else math.isqrt(tp // depth)
    pieces = q**3 if mode == "3d" else q * q
    if q < 2 or (mode != "3d" and q * q * depth != tp):
        return False
    kv = shape.kv_heads != shape.n_head and bool(shape.kv_heads % q or shape.kv_width % pieces)
    return not (kv or shape.n_head % q or shape.vocab_size % q or shape.d_model % pieces or shape.ffn % pieces)


def grid_modes(tp: int, space: Space) -> list[tuple[str, int]]:
    """(mode, depth) of every grid or cube a degree tp can form among the space's modes: a q x q grid, a d x q x q
    Tesseract (d >= 2; `Space.max_depth`), a q^3 cube."""
    out = [("2d", 1)] + [("2.5d", d) for d in range(2, min(tp // 4, space.max_depth) + 1) if tp % d == 0] + [("3d", 1)]
    return [(m, d) for m, d in out if m in space.tp_modes]


def tp_choices(work: Workload, world: int, space: Space, cluster: ClusterSpec) -> list[tuple[int, str, int]]:
    """(degree, mode, depth) triples: every 1-D degree of `tp_degrees`, and the grids and cubes (`grid_modes`) of the
    world's divisors within the same cap that the runtime runs (`grid_allowed`)."""
    out = [(t, "1d", 1) for t in tp_degrees(work, world, space, cluster)] if "1d" in space.tp_modes else []
    cap = space.max_tp or cluster.devices_per_node
    for t in allowed(space.tp, divisors(world)):
        if space.tp is None and t > cap:
            continue
        out += [(t, m, d) for m, d in grid_modes(t, space) if grid_allowed(work, t, m, d)]
    return out


def schedules_for(pp: int, m: int, n_layer: int, space: Space) -> list[tuple[str, int]]:
    """(schedule, chunks) pairs that can run pp stages and m micro-batches over n_layer blocks."""
    if pp == 1:
        return [("1f1b", 1)]
    out = [(s, 1) for s in ("1f1b", "gpipe", "zb-h1") if s in space.schedules]
    if "interleaved" in space.schedules and m % pp == 0:
        out += [("interleaved", v) for v in space.chunks if pp * v <= n_layer]
    if "chimera" in space.schedules and pp % 2 == 0 and m % pp == 0:
        out.append(("chimera", 1))
    if "zbv" in space.schedules and 2 * pp <= n_layer:
        out.append(("zbv", 2))
    if "dualpipev" in space.schedules and 2 * pp <= n_layer and m >= 2 * pp:
        out.append(("dualpipev", 2))
    if "1f1b-scp" in space.schedules:
        out.append(("1f1b-scp", 1))
    return out


def ep_degrees(work: Workload, room: int, space: Space) -> list[int]:
    """Expert-parallel degrees that divide `room` (the world over tp x pp) and every MoE layer's experts."""
    experts = {e for e in work.census.shape.experts if e}
    return [e for e in allowed(space.ep, divisors(room)) if (experts and all(n % e == 0 for n in experts)) or e == 1]


def cp_degrees(work: Workload, room: int, pp: int, ep: int, space: Space, cluster: ClusterSpec) -> list[int]:
    """Context-parallel degrees that divide `room` (the world over tp x pp x ep), up to a node's devices unless pinned,
    under a pipeline too (each stage passes its cp shard on); an MoE model (with or without ep) only when dropless and
    without noisy gating (`context_problems`: a capacity fills over whole sequences, noise would differ per cp rank)."""
    if (ep > 1 or any(work.census.shape.experts)) and (work.capacity_factor is not None or work.noisy_gating):
        return [1]
    cap = space.max_cp or cluster.devices_per_node
    return [c for c in allowed(space.cp, divisors(room)) if c == 1 or space.cp is not None or c <= cap]


def cp_modes(work: Workload, tp: int, cp: int, sp: bool, space: Space) -> list[str]:
    """The context-parallel attentions that can split this sequence over cp ranks (`context_problems`): the ring cuts it
    into 2cp equal chunks, Ulysses into cp and needs cp to divide each tp rank's heads; under sequence parallelism each
    cp rank's tokens must split over tp."""
    if cp == 1:
        return ["ring"]
    s, heads = work.seq_len, work.census.shape.n_head // tp
    fits = {"ring": s % (2 * cp) == 0, "ulysses": s % cp == 0 and heads % cp == 0}
    return [m for m in space.cp_modes if fits.get(m) and not (sp and (s // cp) % tp)]


def offload_allowed(off: Offload, zero: int, pp: int, work: Workload, schedule: str = "1f1b") -> bool:
    """Whether the runtime can run this placement at this stage (`offload_problems`): ZeRO-Offload's moments at stages
    1-2; streamed units at stage 3 without a pipeline, and under one (each stage streaming its own units,
    offload/stage_stream.py: stage 0, which means the same for streamed units) with any schedule that keeps one
    replica of each stage (not Chimera) and an untied model without a LoRA base; no streamed experts."""
    if not off.enabled:
        return True
    if off.zero_offload:
        return zero in (1, 2)
    if any(work.census.shape.experts):
        return False
    if pp == 1:
        return zero == 3
    return zero == 0 and schedule != "chimera" and not work.census.shape.tied and work.census.lora is None


def enumerate_layouts(work: Workload, world: int, space: Space, cluster: ClusterSpec, offload: tuple[Offload, ...] | None = None) -> list[Layout]:
    """Every layout of `world` processes the space allows (before boundaries and recomputation are chosen), with each
    placement of `offload` (default: the space's pinned ones, else the device only)."""
    out = []
    for tp, mode, depth in tp_choices(work, world, space, cluster):
        for pp in allowed(space.pp, [p for p in divisors(world // tp) if p <= work.census.shape.n_layer]):
            for ep in ep_degrees(work, world // (tp * pp), space):
                for cp in cp_degrees(work, world // (tp * pp * ep), pp, ep, space, cluster) if mode in ("1d", "2d") else [1]:
                    found = degree_layouts(work, space, world // (tp * pp * ep * cp), tp, pp, ep, cp, offload)
                    out += found if mode == "1d" else grid_layouts(found, mode, depth, work.census.shape.n_head)
    return out


def grid_layouts(layouts: list[Layout], mode: str, depth: int, n_head: int) -> list[Layout]:
    """The grid (cube) versions of 1-D layouts of the same degree that it composes with (`twod_problems.unsupported`):
    no sequence parallelism, every state on the device, micro-batches of whole sequence blocks (q rows, d x q under
    2.5-D, q^2 on a cube), any pipeline, any ZeRO stage, and on a 2-D grid context parallelism (Ulysses where cp
    divides a grid column's n_head / q heads)."""
    grids = [lay.but(tp_mode=mode, tp_depth=depth) for lay in layouts if not lay.sp and not lay.offload.enabled]
    heads = heads_per_rank(n_head, grids[0].tp, mode, depth) if grids else 0
    return [lay for lay in grids if lay.micro_batch % lay.batch_blocks == 0 and (lay.cp_mode != "ulysses" or lay.cp == 1 or heads % lay.cp == 0)]


def degree_layouts(work: Workload, space: Space, dp: int, tp: int, pp: int, ep: int, cp: int, offload: tuple[Offload, ...] | None) -> list[Layout]:
    """The layouts of one choice of degrees: micro-batch sizes, schedules, ZeRO stages, SP, cp attentions, placements."""
    shape, batch = work.census.shape, work.global_batch
    placements = offload or space.offload or (Offload(),)
    if (space.dp is not None and dp not in space.dp) or batch % (dp * ep):
        return []
    out = []
    for mb in allowed(space.micro_batch, divisors(batch // (dp * ep))):
        m = batch // (dp * ep * mb)
        for schedule, v in schedules_for(pp, m, shape.n_layer, space):
            for zero in space.zero:
                if (zero == 3 and pp > 1) or (zero == 2 and schedule == "chimera") or (zero == 0 and work.param_dtype != "fp32"):
                    continue
                for sp in sorted({s and tp > 1 for s in space.sp}):
                    if sp and work.seq_len % tp:
                        continue
                    for mode in cp_modes(work, tp, cp, sp, space):
                        for off in placements:
                            if offload_allowed(off, zero, pp, work, schedule) and not (cp > 1 and off.enabled):
                                out.append(Layout(dp, tp, pp, zero, sp, mb, m, schedule, v, ep=ep, offload=off, cp=cp, cp_mode=mode))
    return out


def device_limit(cluster: ClusterSpec, space: Space) -> float:
    """Bytes a plan's busiest rank may use: the device's usable memory less the memory model's margin."""
    return cluster.device.usable_bytes * (1 - space.margin)


def within_margin(cost: PlanCost, cluster: ClusterSpec, space: Space) -> PlanCost:
    """`cost` judged against the margin: its `fits` then means below the device's usable memory less the margin."""
    return replace(cost, limit=device_limit(cluster, space))


def host_fits(cost: PlanCost, cluster: ClusterSpec, space: Space) -> bool:
    """Whether a node's host memory, less the margin, holds what all its devices offload to it."""
    host = max((m.host for m in cost.memory), default=0.0) * cluster.devices_per_node
    return host <= cluster.host.memory_gb * 1e9 * (1 - space.margin)


def fit_layout(work: Workload, lay: Layout, cluster: ClusterSpec, space: Space) -> PlanCost:
    """`lay` with its stage boundaries and recomputing ranks chosen, priced (it may still not fit)."""
    limit = device_limit(cluster, space)
    if lay.pp == 1:
        plain = within_margin(price(work, lay, cluster), cluster, space)
        if plain.fits or not space.recompute:
            return plain
        return within_margin(price(work, lay.but(recompute=(0,)), cluster), cluster, space)
    if lay.schedule in SINGLE_STAGE_SCHEDULES and not lay.offload.streams:
        cut = cut_stages(stage_models(work, lay, cluster, allow_recompute=space.recompute), work.census.shape.n_layer, limit)
        if cut is not None:
            return within_margin(price(work, lay.but(boundaries=cut[0], recompute=cut[1]), cluster, every_rank=False), cluster, space)
    bounds = planned_bounds(work, lay)
    plain = lay.but(boundaries=bounds)
    if lay.schedule == "1f1b-scp" or lay.offload.streams:  # the schedule (check_scp_recompute) or the streamer recomputes
        return within_margin(price(work, plain, cluster, every_rank=False), cluster, space)
    over = [r for r in range(lay.pp) if stage_memory(work, plain, r, [(s, bounds[s + 1] - bounds[s]) for s in plain.held_stages(r)]).peak > limit]
    cost = price(work, plain.but(recompute=tuple(over)) if over and space.recompute else plain, cluster, every_rank=False)
    return within_margin(cost, cluster, space)


def memory_floor(work: Workload, lay: Layout) -> float:
    """A lower bound of the busiest rank's device memory: the model states of an even share of the parameters that stay
    on the device."""
    share = work.share(lay)
    mean = (work.census.shape.n_layer * share.block + share.embed + share.head) / lay.pp
    return sum(placed(state_bytes(int(mean), lay, work), lay)["device"])


def search(
    work: Workload, cluster: ClusterSpec, world: int, space: Space = Space(), *, cfg: Any = None, top: int = 8, exact: int = 4
) -> SearchResult:
    """Rank the layouts of `world` processes for `work` on `cluster` (see the module docstring); `cfg`: the config whose
    plan the layouts replace, for `problems()`. Offload placements are searched only when no plan on the devices fits."""
    t0 = time.perf_counter()
    cluster = cluster.with_nodes(world)
    result = search_layouts(work, cluster, world, space, enumerate_layouts(work, world, space, cluster), cfg=cfg, top=top)
    if not result.ranked and space.offload is None:
        offloaded = search_layouts(work, cluster, world, space, enumerate_layouts(work, world, space, cluster, OFFLOAD_PLACEMENTS), cfg=cfg, top=top)
        unfit = sorted(result.unfit + offloaded.unfit, key=lambda c: c.peak_memory)[:top]
        result = SearchResult(
            offloaded.ranked, unfit, result.layouts + offloaded.layouts, result.priced + offloaded.priced, result.refused + offloaded.refused
        )
    # every row priced on every rank by one function (all simulated, or all in closed form)
    ranked = [within_margin(c, cluster, space) for c in price_ranking(work, result.ranked, cluster, simulate=exact > 0)]
    result.ranked = sorted((c for c in ranked if c.fits), key=rank_key)  # every rank priced: none above the margin is kept
    result.unfit = sorted(result.unfit + [c for c in ranked if not c.fits], key=lambda c: c.peak_memory)[:top]
    result.seconds = time.perf_counter() - t0
    return result


def search_layouts(work: Workload, cluster: ClusterSpec, world: int, space: Space, layouts: list[Layout], *, cfg: Any, top: int) -> SearchResult:
    """Branch and bound over `layouts`: priced in the order of their time floor, stopping once the floor exceeds the
    `top`-th best plan found; each plan that fits is asked `problems()` before it is ranked."""
    limit = device_limit(cluster, space)
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
        if not (cost.fits and host_fits(cost, cluster, space)):
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
        lightest = sorted(layouts, key=lambda l: memory_floor(work, l))[:top]
        unfit = sorted((fit_layout(work, lay, cluster, space) for lay in lightest), key=lambda c: c.peak_memory)
    return SearchResult(ranked, unfit, len(layouts), priced, refused)


def rank_key(cost: PlanCost) -> tuple:
    """Step time, then the simplest plan: less offloaded (device, host memory, disk), fewer ranks recomputing, lower ZeRO
    stage, less memory."""
    lay = cost.layout
    return (round(cost.step_seconds, 12), offload_rank(lay.offload), len(lay.recompute), lay.zero, cost.peak_memory, lay.describe())


def offload_rank(off: Offload) -> int:
    """0 on the device, then the order of OFFLOAD_PLACEMENTS (lighter I/O first); a placement a user wrote ranks last."""
    if not off.enabled:
        return 0
    return 1 + OFFLOAD_PLACEMENTS.index(off) if off in OFFLOAD_PLACEMENTS else len(OFFLOAD_PLACEMENTS) + 1


def simulated(work: Workload, cost: PlanCost, cluster: ClusterSpec) -> PlanCost:
    """The plan priced again with the schedule simulator (pipelines small enough to simulate quickly)."""
    lay = cost.layout
    if lay.pp == 1 or not simulable(lay):
        return cost
    return price(work, lay.but(boundaries=cost.bounds), cluster, exact=True)


def refusals(cfg: Any, lay: Layout, world: int) -> list[Any]:
    """What `problems()` says of the config with this layout's plan (the runtime refuses exactly these)."""
    from behemoth.planner.feasibility import problems

    return problems(config_of(cfg, lay), world)


def config_of(cfg: Any, lay: Layout) -> Any:
    """`cfg` running `lay`: its plan as the `parallel:` section, its placement as the `offload:` one (a user's offload
    section is kept when the layout keeps every state on the device and the config did too)."""
    update: dict[str, Any] = {"parallel": lay.to_plan(cfg.parallel), "train": cfg.train.model_copy(update={"micro_batch": None})}
    if lay.offload.enabled or cfg.offload.enabled:
        update["offload"] = type(cfg.offload).model_validate(lay.offload.to_config(cfg.offload))
    return cfg.model_copy(update=update)
