"""One rank's part of a model under a plan, laid out on the meta device by the runtime's own functions.

`parallelize` cuts the pipeline stages, splits tensor-parallel layers and keeps E / ep experts with process groups;
here the same functions run without them (`resolve_stage_boundaries`, `cut_model`, `tied_peer` and
`stage_parameters` of the pipeline, `plan_tensor_parallel`, `plan_expert_parallel`): their shapes depend on the
degrees alone, and every rank of one pipeline rank holds equal shapes. So the planner's memory estimate is the
runtime's layout of any world size, in no memory and with no process started. ZeRO's units and buckets are then
planned over it by `memory.py` (`plan_units`, `split_expert_units`, `FlatLayout`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from behemoth.models.causal_lm import CausalLM, build_causal_lm
from behemoth.parallel.expert import plan_expert_parallel
from behemoth.parallel.pipeline.apply import stage_parameters, tied_peer
from behemoth.parallel.pipeline.partition import cut_model
from behemoth.parallel.pipeline.schedules import build_schedule
from behemoth.parallel.tensor import TensorPolicy, plan_tensor_parallel
from behemoth.parallel.tensor.cube import Grid3D
from behemoth.parallel.tensor.summa import Grid2D
from behemoth.parallel.tensor.threed import apply_tensor_parallel_3d
from behemoth.parallel.tensor.twod import apply_tensor_parallel_2d
from behemoth.parallelize import resolve_stage_boundaries
from behemoth.topology import ParallelDims


@dataclass
class RankModel:
    """A rank's part of the model (meta), the parameters of each pipeline stage it holds (None without a pipeline) and
    which parameters are expert weights (synchronised over dp alone; every other one over dp x ep)."""

    lm: CausalLM
    dims: ParallelDims
    stage_params: dict[int, list[nn.Parameter]] | None = None
    is_expert: Callable[[str], bool] | None = None

    @property
    def module(self) -> nn.Module:
        return self.lm.module


def split_model(lm: CausalLM, tp: int, ep: int, sequence_parallel: bool = False) -> Callable[[str], bool] | None:
    """Split `lm` (meta) in place as tensor and expert parallelism of degrees `tp` and `ep` do (parallelize's steps 2-3);
    the test for expert weights when the model has experts."""
    if tp > 1:
        plan_tensor_parallel(lm.module, tp, TensorPolicy(lm.tp_plan, sequence_parallel, lm.transposed, lm.norms))
        lm.after_tensor_parallel(tp)
    if not lm.moe_layers:
        return None
    return plan_expert_parallel(lm.module, ep, layers=lm.moe_layers, tp=tp).is_expert


def split_grid(lm: CausalLM, tp: int, mode: str, depth: int = 1) -> None:
    """Split `lm` (meta) in place as 2-D (`mode` 2d), 2.5-D (2.5d, `depth` grids) or 3-D (3d) tensor parallelism does
    (parallelize.apply_2d), for the rank at the grid's or cube's origin: with no process group the pieces' shapes are
    a function of the degrees alone, and the refusals (`tensor2d_problems`, `tensor3d_problems`) guarantee every rank
    holds equal ones."""
    if mode == "3d":
        apply_tensor_parallel_3d(lm.module, Grid3D.shape_only(round(tp ** (1 / 3)), 0), lm.tp3d_plan or {})
        return
    q = math.isqrt(tp // depth)
    apply_tensor_parallel_2d(lm.module, Grid2D(q, 0, 0, None, None, depth=depth), lm.tp2d_plan or {})


def rank_model(cfg: Any, dims: ParallelDims, pp_rank: int = 0, *, streamed: bool = False) -> RankModel:
    """Pipeline rank `pp_rank`'s part of the config's model on `dims`, as `parallelize` lays it out (steps 1-3; a 2-D,
    2.5-D or 3-D plan by `split_grid`); `streamed`: its stages streamed by offload (a tied embedding's last-stage copy
    is the whole embedding unit)."""
    lm, plan = build_causal_lm(cfg.model, cfg.hf), cfg.parallel
    stages, shared = None, False
    if dims.pp > 1:
        batch = cfg.batch_layout(dims)
        schedule = build_schedule(plan.schedule, dims.pp, batch.accum, plan.schedule_chunks)
        bounds = resolve_stage_boundaries(plan, lm, cfg.seq_len, batch.micro_batch)  # balance=time: by FLOPs before launch
        stages = cut_model(lm.module, schedule.chunk_stages[pp_rank], bounds, lm.layers, lm.shape.tied, streamed=streamed)
        shared = tied_peer(schedule, pp_rank, lm.shape.tied) is not None
    if dims.tp > 1 and plan.tp_mode != "1d":  # a grid or cube: every parameter cut to 1/q^2 or 1/q^3 (no experts: refused)
        split_grid(lm, dims.tp, plan.tp_mode, plan.tp_depth if plan.tp_mode == "2.5d" else 1)
        is_expert = None
    else:
        is_expert = split_model(lm, dims.tp, dims.ep, plan.sequence_parallel)
    held = stage_parameters(lm.module, stages, lm.layers, shared=shared) if stages is not None else None
    return RankModel(lm, dims, held, is_expert)
