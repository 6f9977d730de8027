"""The exact memory estimator: model-state bytes per rank at each ZeRO stage, for any layout.

Two numbers per stage. The *formula* is the ZeRO paper's, for Ψ parameters on N ranks with Adam:
bytes per parameter are (param, grad, optimizer) = (4, 4, 8) in float32 and (2, 2, 12) with bf16
compute (the 12 are float32 master weights and two moments), so

    stage 0: (p + g + k)Ψ   stage 1: (p + g)Ψ + kΨ/N   stage 2: pΨ + (g + k)Ψ/N   stage 3: (p + g + k)Ψ/N

The *exact* estimate lays the model out as behemoth does (the same buckets and units, each padded
with at most N - 1 elements so it splits evenly) and adds the short-lived buffers: gradient buckets
in flight at stage 2; at stage 3 the gathered parameters (the embedding, `1 + prefetch` blocks or the
head at a time) and the unit gradients being reduce-scattered. It is what a rank really holds, to the
byte, and the tests check the engine's measurement against it; so is the traffic of a step. Activations
are not part of either (footprint.py adds them, and prices plans of any size in closed form).

Under tensor, pipeline and expert parallelism a rank holds only its part of the model: `rank.py` lays it out with the
runtime's own functions (the stage cut, the tensor-parallel split, E / ep experts) on the meta device, so the estimate
of a layout of any world size is a rank's real layout: 16Ψ/(t p) bytes at ZeRO-0 (plus what t does not split and the
embedding and head of the first and last stage), divided further by dp x ep as the ZeRO stage shards (expert weights
by dp alone: they are distinct on each ep rank).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from behemoth.comm import plan_buckets
from behemoth.errors import Problem
from behemoth.models.layered import view_of
from behemoth.parallel.zero.layout import FlatLayout
from behemoth.parallel.zero.runtime import MAX_BUCKETS_IN_FLIGHT, plan_stage_buckets, shards_nothing
from behemoth.parallel.zero.units import ExpertUnits, LayerNames, UnitSpec, plan_units, split_expert_units
from behemoth.planner.rank import rank_model

GiB = 2**30
STAGES = (0, 1, 2, 3)
BYTES_PER_PARAM = {"fp32": (4, 4, 8), "bf16": (2, 2, 12)}  # (param, grad, optimizer incl. master) for Adam


def formula_bytes(psi: int, n: int, stage: int, param_dtype: str = "fp32") -> dict[str, float]:
    """The ZeRO paper's model-state bytes per rank: parameters, gradients, optimizer state."""
    p, g, k = BYTES_PER_PARAM[param_dtype]
    return {
        "params": p * psi / (n if stage >= 3 else 1),
        "grads": g * psi / (n if stage >= 2 else 1),
        "optimizer": k * psi / (n if stage >= 1 else 1),
    }


def formula_text(stage: int, param_dtype: str = "fp32") -> str:
    """The stage's formula as the paper writes it, e.g. `4Ψ + 12Ψ/N`."""
    p, g, k = BYTES_PER_PARAM[param_dtype]
    whole, sharded = [(p + g + k, 0), (p + g, k), (p, g + k), (0, p + g + k)][stage]
    return " + ".join(t for t in (f"{whole}Ψ" if whole else "", f"{sharded}Ψ/N" if sharded else "") if t)


def bytes_per_param(n: int, stage: int, param_dtype: str = "fp32") -> float:
    return sum(formula_bytes(1, n, stage, param_dtype).values())


@dataclass
class StageEstimate:
    """Bytes one rank holds at one stage: exact (padded layout) and by the formula."""

    stage: int
    psi: int
    padding: int  # elements added so that groups split evenly over the ranks
    params: int
    grads: int
    optimizer: int
    formula: dict[str, float]
    groups: int = 0  # flat groups (buckets or units), each padded by fewer than N elements
    buffers: dict[str, int] = field(default_factory=dict)
    traffic: int = 0  # elements all-gathered + reduce-scattered (all-reduced twice) in a step of one micro-batch

    @property
    def states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.states + sum(self.buffers.values())


def real_elements(layout: FlatLayout, rank: int) -> int:
    """Elements of parameters (not padding) in this rank's shard."""
    return sum(p.numel for p in layout.pieces(rank))


Select = Callable[[str], bool]


def _buckets(
    model: Any, n: int, bucket_mb: float, stage_params: dict[int, list[Any]] | None = None, select: Select | None = None
) -> list[FlatLayout]:
    """The gradient buckets behemoth builds at stages 1-2 for the parameters `select` accepts (one sync's), under a
    pipeline per stage (`ZeroStage1._buckets`)."""
    named = [(name, p) for name, p in model.named_parameters() if select is None or select(name)]
    params = [p for _, p in named]
    names = {id(p): name for name, p in named}

    def layout(bucket: list[Any]) -> FlatLayout:
        return FlatLayout([names[id(p)] for p in bucket], [tuple(p.shape) for p in bucket], n)

    if stage_params is None:
        return [layout(b) for b in plan_buckets(reversed(params), int(bucket_mb * 2**20))]
    per_stage, shared = plan_stage_buckets(params, stage_params, int(bucket_mb * 2**20))
    return [layout(b) for stage in sorted(per_stage) for b in per_stage[stage]] + [layout(b) for b in shared]


def _window_max(sizes: list[int], width: int) -> int:
    return max((sum(sizes[i : i + width]) for i in range(max(1, len(sizes) - width + 1))), default=0)


@dataclass(frozen=True)
class ExpertSync:
    """Under expert parallelism (ep > 1): which parameters are expert weights, synchronised over the `n` dp ranks alone
    (every other parameter over dp x ep), and this rank's place among them."""

    is_expert: Select
    n: int
    rank: int = 0


def _units(
    model: Any, n: int, layers: LayerNames, tie_embeddings: bool, experts: ExpertSync | None
) -> tuple[list[UnitSpec], list[FlatLayout], list[int]]:
    """Stage 3's units as `shard_parameters` plans them (expert units apart, over dp), their layouts and this rank's place in each."""
    units = plan_units(model, layers=layers, tie_embeddings=tie_embeddings)
    if experts is None:
        return units, [FlatLayout(u.names, u.shapes, n) for u in units], [-1] * len(units)
    units = split_expert_units(model, units, ExpertUnits(experts.is_expert, None))  # type: ignore[arg-type]  # no group: shapes only
    apart = [all(experts.is_expert(name) for name in u.names) for u in units]
    return (units, [FlatLayout(u.names, u.shapes, experts.n if e else n) for u, e in zip(units, apart)], [experts.rank if e else -1 for e in apart])


def _syncs(
    model: Any, n: int, bucket_mb: float, stage_params: dict[int, list[Any]] | None, experts: ExpertSync | None
) -> list[tuple[list[FlatLayout], int]]:
    """Stages 1-2: the buckets of each gradient sync and this rank's place in its group (-1: the data rank): one sync, or
    with experts one over dp x ep for the dense parameters and one over dp for the experts (`build_syncs`)."""
    if experts is None:
        return [(_buckets(model, n, bucket_mb, stage_params), -1)]
    return [
        (_buckets(model, n, bucket_mb, stage_params, lambda name: not experts.is_expert(name)), -1),
        (_buckets(model, experts.n, bucket_mb, stage_params, experts.is_expert), experts.rank),
    ]


def stage_estimate(
    model: Any,
    stage: int,
    n: int,
    *,
    param_dtype: str = "fp32",
    bucket_mb: float = 25.0,
    prefetch: int = 1,
    rank: int = 0,
    layers: LayerNames | None = None,
    tie_embeddings: bool = False,
    stage_params: dict[int, list[Any]] | None = None,
    experts: ExpertSync | None = None,
    regathers: bool = True,
) -> StageEstimate:
    """Exact bytes data rank `rank` of `n` holds at `stage` for `model` (a meta model is enough; `layers`: GPT's by default;
    `stage_params`: under a pipeline, the parameters of each stage the rank holds, bucketed per stage; `experts`: expert
    weights synchronised over a group of their own; `regathers`: whether stage 3 gathers units again in backward, not
    on a 3-D cube: `Layout.regathers_units`)."""
    p, g, k = BYTES_PER_PARAM[param_dtype]
    psi = sum(t.numel() for t in model.parameters())
    formula = formula_bytes(psi, n, stage, param_dtype)
    if stage == 0:
        return StageEstimate(0, psi, 0, 4 * psi, 4 * psi, 8 * psi, formula, traffic=2 * psi)
    units: list[UnitSpec] = []
    if stage == 3:
        units, layouts, places = _units(model, n, layers or view_of("gpt"), tie_embeddings, experts)
        windows = [layouts]
    else:
        syncs = _syncs(model, n, bucket_mb, stage_params, experts)
        windows = [lays for lays, _ in syncs]
        layouts, places = [lay for lays, _ in syncs for lay in lays], [r for lays, r in syncs for _ in lays]
    padded = sum(lay.padded for lay in layouts)
    shard = sum(lay.shard_size for lay in layouts)
    mine = sum(real_elements(lay, rank if r < 0 else r) for lay, r in zip(layouts, places))
    master = 4 * shard if param_dtype != "fp32" else 0  # a separate float32 copy only with bf16 compute
    est = StageEstimate(
        stage,
        psi,
        padded - psi,
        p * (shard if stage == 3 else padded),
        g * (shard if stage >= 2 else padded),
        8 * mine + master,
        formula,
        len(layouts),
    )
    if stage == 2:
        est.buffers["grad_buffers_peak"] = sum(_window_max([lay.padded * p for lay in lays], MAX_BUCKETS_IN_FLIGHT + 1) for lays in windows)
    if stage == 3:
        sizes = UnitSizes.of(units, layouts)
        est.buffers.update(stage3_buffers(sizes, prefetch, p))
        est.traffic = sizes.gathered(regathers) + padded
    else:
        est.traffic = 2 * padded
    return est


@dataclass
class UnitSizes:
    """Padded elements of stage 3's units by role; `tied`: the units a tied head gathers again (the embedding);
    `experts`: under expert parallelism, each block's expert unit (0 where it has none), gathered inside its block."""

    root: int
    embedding: list[int]
    blocks: list[int]
    head: list[int]
    tied: int
    experts: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, units: list[UnitSpec], layouts: list[FlatLayout]) -> UnitSizes:
        size = {id(u): lay.padded for u, lay in zip(units, layouts)}
        role = {r: [size[id(u)] for u in units if u.role == r] for r in ("root", "embedding", "head")}
        blocks: dict[int, list[int]] = {}  # a block's units: its own, then its experts' (split_expert_units' order)
        for u in units:
            if u.role == "block":
                blocks.setdefault(id(u.module), []).append(size[id(u)])
        tied = sum(size[id(r)] for u in units if u.role == "head" for r in u.reads)
        experts = [b[1] if len(b) > 1 else 0 for b in blocks.values()]
        return cls(sum(role["root"]), role["embedding"], [b[0] for b in blocks.values()], role["head"], tied, experts if any(experts) else [])

    def gathered(self, regathers: bool = True) -> int:
        """Elements all-gathered per forward and backward: every unit in forward, all but the embedding in backward
        (a lookup needs no weights; none without `regathers`), and a tied embedding once more in each."""
        again = self.root + sum(self.blocks) + sum(self.experts) + sum(self.head) + self.tied
        return (2 if regathers else 1) * again + sum(self.embedding)


def _nested_peak(sizes: UnitSizes, prefetch: int, head: list[int]) -> int:
    """Gathered elements at their peak when each block's expert unit is gathered inside the block's own (ep > 1): entering
    the inner one of a pair (forward: the experts; backward: the block, whose backward ends after its experts') holds the
    pair and prefetches the next `prefetch` units of that pass's order."""
    pairs = list(zip(sizes.blocks, sizes.experts))
    forward = sizes.embedding + [u for d, x in pairs for u in (d, x)] + head
    backward = head + [u for d, x in pairs[::-1] for u in (x, d)]
    held = [sum(forward[: 1 + prefetch]), sum(backward[: 1 + prefetch])]  # entering the first unit of each pass
    for order, first in ((forward, len(sizes.embedding)), (backward, len(head))):
        held += [order[at - 1] + sum(order[at : at + 1 + prefetch]) for at in range(first + 1, first + 2 * len(pairs), 2)]
    return sizes.root + max(held)


def stage3_buffers(sizes: UnitSizes, prefetch: int, bytes_per: int) -> dict[str, int]:
    """Peaks of stage 3's gathered parameters and of unit gradients in flight (sharded.py's order of events).

    Forward enters the root and embedding, then each block, then the head (with the embedding again when the head
    is tied to it); each entry prefetches the next `prefetch` units, and the embedding is dropped when the first block
    starts. Backward gathers the head and blocks again one or two at a time, so forward holds the peak (with expert
    units, `_nested_peak`). Unit gradients complete head first, embedding last, two alive at once (one reduce-scatter
    in flight); a tied embedding's first gradient (from the head) is kept until the second arrives, to be summed and
    reduce-scattered once.
    """
    head = [sum(sizes.head) + sizes.tied] if sizes.head or sizes.tied else []
    if sizes.experts:
        gathered = _nested_peak(sizes, prefetch, head)
        blocks = [u for d, x in zip(sizes.blocks[::-1], sizes.experts[::-1]) for u in (x, d) if u]
    else:
        gathered = sizes.root + _window_max(sizes.embedding + sizes.blocks + head, 1 + prefetch)
        blocks = sizes.blocks[::-1]
    completion = sizes.head + blocks + sizes.embedding + ([sizes.root] if sizes.root else [])  # the order gradients complete
    kept_until = len(sizes.head) + len(blocks) if sizes.tied else -1  # the tied gradient is kept until the embedding's
    grads = max((sum(completion[max(0, i - 1) : i + 1]) + (sizes.tied if i <= kept_until else 0) for i in range(len(completion))), default=0)
    return {"gathered_peak": gathered * bytes_per, "grad_buffers_peak": grads * bytes_per}


def estimate(
    cfg: Any, n: int | None = None, *, rank: int = 0, stages: tuple[int, ...] = STAGES, world: int | None = None, pp_rank: int = 0
) -> list[StageEstimate]:
    """Every ZeRO stage's exact estimate for data rank `rank` of pipeline rank `pp_rank` of the config's plan on `world`
    processes (default: `n` data-parallel ranks and the plan's other degrees), laid out as `parallelize` lays it out
    (rank.py), on the meta device: no memory."""
    plan = cfg.parallel
    world = world if world is not None else (n or 1) * plan.tp * plan.pp * plan.ep
    dims = plan.dims(world)
    part = rank_model(cfg, dims, pp_rank)
    lm = part.lm
    experts = ExpertSync(part.is_expert, dims.dp, rank // dims.ep) if part.is_expert is not None and dims.ep > 1 else None
    runs_as = {s: 0 if shards_nothing(s, plan.param_dtype, "device", dims.data_ranks) else s for s in stages}  # as the engine runs it
    return [
        replace(
            stage_estimate(
                lm.module,
                runs_as[s],
                dims.data_ranks,
                param_dtype=plan.param_dtype if runs_as[s] else "fp32",
                bucket_mb=plan.bucket_mb,
                prefetch=plan.prefetch,
                rank=rank,
                layers=lm.layers,
                tie_embeddings=lm.shape.tied,
                stage_params=part.stage_params if runs_as[s] in (1, 2) else None,
                experts=experts,
                regathers=not (plan.tp_mode == "3d" and plan.tp > 1 and not plan.tp_regather),
            ),
            stage=s,
        )
        for s in stages
    ]


def largest_fitting(memory_bytes: float, n: int, param_dtype: str = "fp32") -> dict[int, int]:
    """The most parameters whose model states fit `memory_bytes` per rank at each stage (formula, no buffers)."""
    return {s: math.floor(memory_bytes / bytes_per_param(n, s, param_dtype if s else "fp32")) for s in STAGES}


def fit_problems(cfg: Any, dp: int, world: int | None = None) -> list[Problem]:
    """A plan whose model states (exact estimate of pipeline rank 0 (the largest), tp and pp included) exceed
    parallel.memory_gb, with the stage or ranks that would fit."""
    plan = cfg.parallel
    if plan.memory_gb is None:
        return []
    ests = estimate(cfg, dp, world=world)
    need = ests[plan.zero_stage]
    if need.total <= plan.memory_gb * GiB:
        return []
    fitting = [e for e in ests if e.total <= plan.memory_gb * GiB]
    room = plan.memory_gb * GiB - sum(ests[3].buffers.values())  # gathered blocks do not shrink with more ranks
    ranks = math.ceil(bytes_per_param(1, 3, plan.param_dtype) * need.psi / room) if room > 0 else None
    fix = (
        f"use parallel.zero_stage={fitting[0].stage} ({fitting[0].total / GiB:.2f} GiB)"
        if fitting
        else f"use parallel.zero_stage=3 on {ranks} or more ranks"
        if ranks
        else "use a smaller model or more memory per rank (stage 3's gathered blocks alone do not fit)"
    )
    return [
        Problem.of(
            "parallel.memory_gb",
            f"{'the model' if not layout_text(plan) else 'its share of the model on a rank'} ({need.psi / 1e6:.1f}M parameters) needs {need.total / GiB:.2f} GiB per rank for model states at "
            f"parallel.zero_stage={plan.zero_stage} on dp={dp}{layout_text(plan)} (params {need.params / GiB:.2f} + grads {need.grads / GiB:.2f} + "
            f"optimizer {need.optimizer / GiB:.2f} + buffers {sum(need.buffers.values()) / GiB:.2f}), more than parallel.memory_gb={plan.memory_gb}",
            fix,
        )
    ]


def layout_text(plan: Any) -> str:
    """` x ep=2 x tp=2 x pp=4` for the degrees besides dp that a plan sets."""
    return "".join(f" x {k}={getattr(plan, k)}" for k in ("ep", "tp", "pp") if getattr(plan, k) > 1)
