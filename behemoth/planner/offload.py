"""Offload before launch: what lives where, bytes per tier, the disk a run needs, its memory peak and step time.

Pure functions of the config and a few measured rates (offload/calibrate.py measures them), except
`offload_launch_problems`, which looks at the scratch directory and its disk. The model is built on the meta
device, split by tensor parallelism and cut into the runtime's own units and shards over dp (rank.py, `plan_units`),
so every byte here is the runtime's layout.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from behemoth.errors import BehemothError, Problem
from behemoth.models.causal_lm import build_causal_lm
from behemoth.offload import scratch
from behemoth.offload.budget import MemoryPeak, fit_budget, unit_sizes
from behemoth.offload.calibrate import Rates
from behemoth.offload.order import Action, StateSizes, make_order, plan_residencies, stores_grads, swap_bytes
from behemoth.offload.policy import OffloadPolicy
from behemoth.offload.runtime import stream_order
from behemoth.offload.stage_order import pipeline_refusal, stage_order, stage_units
from behemoth.parallel.zero.layout import FlatLayout
from behemoth.parallel.zero.tiers import in_device_memory
from behemoth.parallel.zero.units import ExpertUnits, UnitSpec, plan_units, split_expert_units
from behemoth.parallelize import offload_activations, resolve_stage_boundaries
from behemoth.planner.rank import rank_model
from behemoth.topology import ParallelDims

KINDS = ("params", "grads", "optimizer")


@dataclass
class OffloadEstimate:
    """One rank's offload plan: stored bytes per kind, bytes moved per step per kind, peak memory, FLOPs."""

    policy: OffloadPolicy
    psi: int
    ranks: int  # processes sharing this machine's disk
    stored: dict[str, int]  # bytes per kind of state on this rank (on its tier)
    moved: dict[str, tuple[int, int]]  # (read, written) bytes per step per kind, this rank
    peak: MemoryPeak
    prefetch: int  # the depth that fits the budget
    flops: float  # per step, this rank (forward, recomputation, backward)
    units: int

    def tier_of(self, kind: str) -> str:
        return getattr(self.policy, kind)

    def disk_bytes(self) -> int:
        """Bytes the disk tier holds for all local ranks (checkpoints link these files; 8-bit moments stay 8-bit)."""
        per_rank = sum(n for kind, n in self.stored.items() if self.tier_of(kind) == "disk")
        return per_rank * self.ranks

    def moved_per_tier(self, device_type: str) -> dict[str, tuple[int, int]]:
        """(read, written) bytes per tier that really moves them (device never does; host does only on a GPU)."""
        out: dict[str, list[int]] = {}
        for kind, (r, w) in self.moved.items():
            tier = self.tier_of(kind)
            if in_device_memory(tier, device_type):
                continue
            acc = out.setdefault(tier, [0, 0])
            acc[0] += r
            acc[1] += w
        return {t: (r, w) for t, (r, w) in out.items()}

    def step_time(self, rates: Rates, device_type: str) -> tuple[float, float, float]:
        """(I/O seconds, compute seconds, their max: the bound) for one step; local ranks share the disk."""
        io = 0.0
        for tier, (r, w) in self.moved_per_tier(device_type).items():
            if tier == "disk":
                io += self.ranks * (r / rates.disk_read + w / rates.disk_write)
            else:
                io += (r + w) / rates.host_copy
        compute = self.flops / rates.compute
        return io, compute, max(io, compute)


def offload_estimate(cfg: Any, dp: int, *, ranks: int | None = None, device_type: str = "cpu", pp_rank: int = 0) -> OffloadEstimate:
    """The offload plan of `cfg` on dp data-parallel ranks (tp and pp from the config), the share of data-parallel rank 0
    of pipeline rank `pp_rank` (under a pipeline: its stages' units, visited as its schedule runs its passes). Under
    context parallelism the units are sharded over dp x cp and each rank holds 1/cp of every sequence's activations."""
    dims, cp = rank_dims(cfg, dp), cfg.parallel.cp
    psi = sum(p.numel() for p in build_causal_lm(cfg.model, cfg.hf).module.parameters())
    ranked = rank_model(cfg, dims, pp_rank, streamed=True)  # cut, split by tp and ep on meta, then cut into units as parallelize does
    lm, tp = ranked.lm, dims.tp
    specs, reads, apart = stream_units(lm, ranked.is_expert if dims.ep > 1 else None)
    layouts = [FlatLayout(s.names, s.shapes, dp * cp if e else dp * cp * dims.ep) for s, e in zip(specs, apart)]
    policy = OffloadPolicy.of(cfg.offload, run_dir=cfg.run.dir, grad_clip=cfg.train.grad_clip, param_dtype=cfg.parallel.param_dtype)
    batch = cfg.batch_layout(dims)
    shape = lm.shape
    act = offload_activations(lm, batch, cfg.seq_len // cp, tp)
    tied = any(s.role == "head" and s.reads for s in specs)
    prefetch, _, peak = fit_budget(policy, layouts, 0, act, device_type=device_type, tied=tied)
    sizes = unit_sizes(layouts, 0, policy.bits, compute=policy.compute_bytes)  # float32 masters; bf16 gradients with bf16 params
    order = make_order(policy.order, shape.n_layer, batch.accum) if dims.pp == 1 else stage_visits(cfg, lm, dims, pp_rank)
    plan = plan_residencies(order, reads)
    grads_kept = stores_grads(plan, deferred=not policy.fused)
    stored = {
        "params": sum(u.stored * u.shard for u in sizes),
        "grads": sum(u.compute * u.shard for u in sizes) if grads_kept else 0,
        "optimizer": sum(u.state_bytes for u in sizes),
    }
    moved = swap_bytes(plan, [StateSizes(u.stored * u.shard, u.compute * u.shard, u.state_bytes) for u in sizes], deferred=not policy.fused)
    tokens = batch.micro_batch * batch.accum * cfg.seq_len
    # a block's forward runs twice (recomputed in backward); a split backward's block three times, its input-gradient chain
    # twice (its BI and its W recompute it): 6 forwards' worth for 4
    weights, backwards = sum(a.kind == "W" for a in order), sum(a.kind in ("B", "W") for a in order)
    split = 1 + 0.5 * weights / max(1, backwards)
    flops = lm.flops_per_token(cfg.seq_len) * tokens * 4 / 3 * split / tp / dims.pp / cp
    return OffloadEstimate(policy, psi, ranks or dp * tp * cp, stored, moved, peak, prefetch, flops, len(specs))


def stage_visits(cfg: Any, lm: Any, dims: ParallelDims, pp_rank: int) -> list[Action]:
    """Pipeline rank `pp_rank`'s unit visits for one step (offload/stage_order.py), numbered as its own units are (the
    stages' embedding, blocks and head in forward order), as the stage streamer runs them."""
    from behemoth.parallel.pipeline.apply import tied_peer
    from behemoth.parallel.pipeline.schedules import build_schedule

    plan, batch = cfg.parallel, cfg.batch_layout(dims)
    schedule = build_schedule(plan.schedule, dims.pp, batch.accum, plan.schedule_chunks)
    bounds = resolve_stage_boundaries(plan, build_causal_lm(cfg.model, cfg.hf), cfg.seq_len, batch.micro_batch)
    units = stage_units(bounds)
    held = {u for s in schedule.chunk_stages[pp_rank] for u in units[s]}
    if tied_peer(schedule, pp_rank, lm.shape.tied) is not None:
        held.add(0)  # a tied embedding's copy, read by the last stage's head (offload/stage_tied.py)
    local = {u: i for i, u in enumerate(sorted(held))}
    return [Action(v.kind, local[v.unit], v.mb) for v in stage_order(schedule, pp_rank, units)]


def stream_units(lm: Any, is_expert: Any) -> tuple[list[UnitSpec], dict[int, tuple[int, ...]], list[bool]]:
    """The streamer's units in its order, what each action reads, and which are expert units (over dp alone): with
    experts over ep (`is_expert`), each block's experts in a unit of their own, as `shard_parameters` cuts them."""
    specs = plan_units(lm.module, layers=lm.layers, tie_embeddings=lm.shape.tied)
    if is_expert is None:
        apart = [False] * len(specs)
    else:
        specs = split_expert_units(lm.module, specs, ExpertUnits(is_expert, None))  # no group: shapes only
        apart = [all(is_expert(n) for n in s.names) for s in specs]
    ordered, reads = stream_order(specs, apart)
    return ordered, reads, sorted(apart)


def rank_dims(cfg: Any, dp: int) -> ParallelDims:
    """The mesh of `dp` data-parallel ranks under the config's other degrees (what `Config.batch_layout` splits over)."""
    plan = cfg.parallel
    return ParallelDims(dp * plan.pp * plan.ep * plan.tp, pp=plan.pp, dp=dp, ep=plan.ep, tp=plan.tp)


def offload_placement(cfg: Any) -> str:
    """`offload.params=host, offload.optimizer=disk`: the offload options a plan sets, as written, for a refusal's first words."""
    off = cfg.offload
    placed = [f"offload.{k}={getattr(off, k)}" for k in ("params", "grads", "optimizer") if getattr(off, k) not in ("device", "none", "auto")]
    return ", ".join(placed + ([f"offload.optimizer_bits={off.optimizer_bits}"] if off.optimizer_bits != 32 else []))


def zero_offload(cfg: Any) -> bool:
    """ZeRO-1/2 with only the optimizer's moments on the host tier (ZeRO-Offload): the ZeRO sync keeps them there and
    nothing streams, so it composes as ZeRO-1/2 does."""
    if cfg.parallel.zero_stage not in (1, 2) or not cfg.offload.enabled:
        return False
    return OffloadPolicy.of(cfg.offload, run_dir=cfg.run.dir, grad_clip=cfg.train.grad_clip).optimizer_only


def streams(cfg: Any) -> bool:
    """Whether the plan runs offload's streamer: some state on a tier, other than ZeRO-Offload's moments."""
    return bool(cfg.offload_streams)


def pipeline_offload_problem(cfg: Any, dp: int) -> Problem | None:
    """Offload under a pipeline, where each stage streams its own units in its schedule's order (offload/stage_stream.py),
    refused in one line when it cannot: the schedule's own reason where a stage could not follow its passes
    (offload/stage_order.py). Tied embeddings (offload/stage_tied.py), experts (a block's visits read its expert unit)
    and a LoRA base (read-only units) stream under every other schedule."""
    from behemoth.parallel.pipeline.schedules import build_schedule

    plan = cfg.parallel
    try:
        why = pipeline_refusal(build_schedule(plan.schedule, plan.pp, cfg.batch_layout(rank_dims(cfg, dp)).accum, plan.schedule_chunks))
    except BehemothError:
        return None  # an impossible schedule request: pipeline_problems names it
    if not why:
        return None
    return Problem.of(
        "parallel.pp",
        f"offload with parallel.pp={plan.pp} (parallel.schedule={plan.schedule}): {why}",
        "use parallel.schedule=gpipe, 1f1b, interleaved, zb-h1, zbv, dualpipev or 1f1b-scp, or parallel.pp=1",
    )


def offload_problems(cfg: Any, dp: int, *, fit: bool = True) -> list[Problem]:
    """Why an offload plan cannot run, before launch, from the config alone (pure); `fit`: also size it against its budget."""
    off, plan = cfg.offload, cfg.parallel
    if not off.enabled:
        if off.max_memory_gb is not None:
            return [
                Problem.of(
                    "offload.max_memory_gb",
                    f"offload.max_memory_gb={off.max_memory_gb} but no state is offloaded",
                    "place some on a tier (offload.params=disk, offload.optimizer=disk, ...) or drop the budget",
                )
            ]
        return []
    if zero_offload(cfg):
        return []
    out = []
    if plan.pp > 1 and (piped := pipeline_offload_problem(cfg, dp)) is not None:
        out.append(piped)
    if plan.zero_stage in (1, 2):
        out.append(
            Problem.of(
                "parallel.zero_stage",
                f"parallel.zero_stage={plan.zero_stage} with {offload_placement(cfg)}: ZeRO-{plan.zero_stage} keeps every parameter and its "
                "gradient whole on each rank, so there is no shard to stream: parameters or gradients on a tier are ZeRO-3's "
                "shards (at stages 1-2 only the optimizer's float32 moments move, to host memory: ZeRO-Offload)",
                f"set parallel.zero_stage=3, or keep parameters and gradients on the device with offload.optimizer=host "
                f"(offload.optimizer_bits=32) at stage {plan.zero_stage}",
            )
        )
    if off.step == "fused" and cfg.train.grad_clip > 0:
        out.append(
            Problem.of(
                "offload.step",
                f"offload.step=fused with train.grad_clip={cfg.train.grad_clip}: a unit steps before the global norm is known",
                "set offload.step=deferred (exact clipping) or train.grad_clip=0",
            )
        )
    out += journal_problems(cfg)
    if off.optimizer_bits == 8 and importlib.util.find_spec("bitsandbytes") is None:
        out.append(
            Problem.of(
                "offload.optimizer_bits",
                "offload.optimizer_bits=8 needs bitsandbytes, which is not installed",
                'pip install -e ".[offload]", or use offload.optimizer_bits=32',
            )
        )
    if fit and not out and off.max_memory_gb is not None:
        try:
            offload_estimate(cfg, dp)
        except BehemothError as err:
            out.append(Problem.from_error("offload.max_memory_gb", err))
    return out


def journal_problems(cfg: Any) -> list[Problem]:
    """offload.commit=journal commits each step on the disk tier: every state there, the step after the norm, one stream."""
    off = cfg.offload
    if off.commit != "journal":
        return []
    out = []
    off_disk = [f"offload.{k}={v}" for k, v in (("params", off.params), ("grads", off.grads_tier), ("optimizer", off.optimizer)) if v != "disk"]
    if off_disk:
        out.append(
            Problem.of(
                "offload.commit",
                f"offload.commit=journal with {', '.join(off_disk)}: the journal commits the step on the disk tier, where a kill leaves it",
                "set offload.params=disk offload.optimizer=disk (and offload.grads=auto or disk), or offload.commit=link",
            )
        )
    if off.step == "fused":
        out.append(
            Problem.of(
                "offload.step",
                "offload.step=fused with offload.commit=journal: a fused unit steps before the step is committed",
                "set offload.step=auto or deferred (the journal logs each gradient and applies it after the commit)",
            )
        )
    if cfg.parallel.pp > 1 or cfg.finetune.lora.enabled:
        out.append(
            Problem.of(
                "offload.commit",
                "offload.commit=journal journals one streamed model's states: not a pipeline's stages nor LoRA's resident adapters",
                "set parallel.pp=1 and finetune.lora.enabled=false, or offload.commit=link",
            )
        )
    return out


def offload_launch_problems(cfg: Any, world: int) -> list[Problem]:
    """The scratch directory (another run's, unwritable) and its disk's free space, for the world's local ranks."""
    off = cfg.offload
    if not off.enabled or "disk" not in (off.params, off.grads_tier, off.optimizer):
        return []
    root = scratch.default_scratch(off.dir, cfg.run.dir)
    state, why = scratch.scratch_state(root, cfg.run.dir)
    if state == "refused":
        return [Problem("offload.dir", why)]
    dp = cfg.parallel.dims(world).dp
    need = max(offload_estimate(cfg, dp, ranks=world, pp_rank=r).disk_bytes() for r in range(cfg.parallel.pp))  # the largest stage's
    free = scratch.free_bytes(root) + (dir_bytes(root) if state == "stale-own" else 0)
    if need > free:
        return [
            Problem.of(
                "offload.dir",
                f"offload.dir={root} needs {need / 2**30:.2f} GiB of disk for {world} rank(s) but its disk has {free / 2**30:.2f} GiB free",
                "free space, choose another offload.dir, keep some states in memory (offload.params=device), or use offload.optimizer_bits=8",
            )
        ]
    return []


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
