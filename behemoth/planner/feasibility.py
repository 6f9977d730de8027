"""Can this plan run this model on this world, and if not, why: every reason at once.

`problems(cfg, world)` is the one feasibility function. It reads no data and starts no process, so the
planner can ask it of thousands of candidate plans; `behemoth train` asks it (with `launch_problems`,
which adds the corpus, the checkpoint and the run directory) before any worker starts, and a job that
torchrun started asks it again in each worker. Only the edges raise (`refuse`), with every problem.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from behemoth.config import Config
from behemoth.errors import BehemothError, Problem, Refused, collect
from behemoth.models.causal_lm import model_problems, model_shape
from behemoth.offload.policy import steps_in_backward
from behemoth.parallel.burst.problems import burst_problems
from behemoth.parallel.compile import compile_problems
from behemoth.parallel.context.apply import heads_per_rank
from behemoth.parallel.context.apply import resolve_mode as context_mode
from behemoth.parallel.context.problems import context_problems
from behemoth.parallel.pipeline.partition import check_stage_boundaries
from behemoth.parallel.pipeline.schedules import ScheduleError, check_request
from behemoth.parallel.recompute import recompute_ranks
from behemoth.parallel.tensor.subbatch import subbatch_problems
from behemoth.parallel.tensor.threed_problems import tensor3d_problems
from behemoth.parallel.tensor.twod_problems import tensor2d_problems
from behemoth.planner.memory import fit_problems
from behemoth.planner.offload import offload_launch_problems, offload_problems, streams
from behemoth.topology import ParallelDims


def problems(cfg: Config, world: int) -> list[Problem]:
    """Every reason `cfg` cannot run on `world` processes (empty: it can)."""
    plan = cfg.parallel
    model = [Problem("hf", message) for message in model_problems(cfg.model, cfg.hf, plan)]
    out = model + plan.dims_problems(world) + plan.combination_problems(streamed=streams(cfg))
    if not model:  # a model that cannot be built has no shape to split
        shape = model_shape(cfg.model, cfg.hf)
        out += plan.tensor_parallel_problems(shape.tensor_parallel_sizes(), cfg.seq_len) + expert_problems(cfg, shape)
        out += compile_problems(cfg.train.compile, any(shape.experts))
    out += context_problems(cfg, None if model else model_shape(cfg.model, cfg.hf))
    out += burst_problems(cfg, world, None if model else model_shape(cfg.model, cfg.hf))
    built = None if model else model_shape(cfg.model, cfg.hf)
    if plan.dims_problems(world):
        return out + tensor2d_problems(cfg, built, None) + tensor3d_problems(cfg, built, None)
    dims = plan.dims(world)
    batch = collect("train.global_batch", cfg.batch_layout, dims)
    micro = None if batch else cfg.batch_layout(dims).micro_batch
    out += tensor2d_problems(cfg, built, micro) + tensor3d_problems(cfg, built, micro)
    out += subbatch_problems(cfg, micro)
    out += batch + pipeline_problems(cfg, dims, microbatches=None if batch else cfg.batch_layout(dims).accum)
    if not batch and not model:
        out += routing_group_problems(cfg, dims)
    out += offload_problems(cfg, dims.dp, fit=not out) + fused_step_problems(cfg)
    if not out and not cfg.offload.enabled:  # sizing the memory builds the model (on meta): only for a plan that can otherwise run
        out += fit_problems(cfg, dims.dp, world)
    return out


def fused_step_problems(cfg: Config) -> list[Problem]:
    """train.nonfinite=skip cannot skip a step that is applied during backward (offload's fused step)."""
    if cfg.train.nonfinite != "skip" or not streams(cfg) or not steps_in_backward(cfg.offload.step, cfg.train.grad_clip, cfg.offload.commit):
        return []
    return [
        Problem.of(
            "train.nonfinite",
            f"train.nonfinite=skip with offload.step={cfg.offload.step} and train.grad_clip="
            f"{cfg.train.grad_clip}: each unit steps during backward, before the step is known to be finite, so it "
            "cannot be skipped",
            "set offload.step=deferred (the step waits for the norm), offload.commit=journal (disk tiers: the step is applied after "
            "its commit), or train.nonfinite=stop",
        )
    ]


def pipeline_problems(cfg: Config, dims: ParallelDims, *, microbatches: int | None) -> list[Problem]:
    """A pipeline plan that cannot run: more stages than blocks, micro-batches the schedule cannot use, an odd Chimera
    depth, bad stage boundaries or recompute ranks."""
    plan, n_layer = cfg.parallel, cfg.model.n_layer
    out = collect("parallel.recompute", recompute_ranks, plan.recompute, [1] * plan.pp)
    if plan.pp == 1:
        if plan.stage_boundaries is not None:
            out += collect("parallel.stage_boundaries", check_stage_boundaries, plan.stage_boundaries, n_layer, 1)
        return out
    stages = plan.num_stages
    if stages > n_layer:
        times = f" x parallel.chunks={plan.chunks}" if plan.schedule_chunks > 1 else ""
        out.append(
            Problem.of(
                "parallel.pp",
                f"parallel.pp={plan.pp}{times} makes {stages} pipeline stages but model.n_layer={n_layer}: every stage needs at least one block",
                f"use at most {n_layer} stages or a deeper model",
            )
        )
    if microbatches is not None:
        try:
            check_request(plan.schedule, plan.pp, microbatches, plan.schedule_chunks)
        except ScheduleError as err:
            out.append(Problem("parallel.schedule", as_plan_keys(str(err))))
    if plan.stage_boundaries is not None:
        out += collect("parallel.stage_boundaries", check_stage_boundaries, plan.stage_boundaries, n_layer, stages)
    return out


def expert_problems(cfg: Config, shape: Any) -> list[Problem]:
    """A mixture-of-experts plan that cannot run: experts ep does not divide, k > E, a capacity factor <= 0, ep > 1
    without experts."""
    plan, moe = cfg.parallel, cfg.model.moe
    experts = sorted({e for e in shape.experts if e})
    if not experts:
        if plan.ep > 1:
            return [
                Problem.of(
                    "parallel.ep",
                    f"parallel.ep={plan.ep} but the model has no experts",
                    "set model.moe.experts (or use an MoE preset such as model=gpt-moe-1m, or model=hf:mixtral), or parallel.ep=1",
                )
            ]
        return []
    out = []
    bad = [e for e in experts if e % plan.ep]
    if bad:
        out.append(
            Problem.of(
                "parallel.ep",
                f"parallel.ep={plan.ep} does not divide the {bad[0]} experts of an MoE layer",
                f"choose an ep that divides {', '.join(map(str, experts))}",
            )
        )
    if shape.top_k > min(experts):
        out.append(
            Problem.of(
                "model.moe.top_k", f"model.moe.top_k={shape.top_k} exceeds the {min(experts)} experts of an MoE layer", f"use top_k <= {min(experts)}"
            )
        )
    for key in ("capacity_factor", "eval_capacity_factor"):
        value = getattr(moe, key)
        if value is not None and value <= 0:
            out.append(
                Problem.of(
                    f"model.moe.{key}",
                    f"model.moe.{key}={value}: a capacity must be positive",
                    "set a factor > 0 (e.g. 1.25), or leave it unset for dropless routing",
                )
            )
    return out


def routing_group_problems(cfg: Config, dims: ParallelDims) -> list[Problem]:
    """Routing groups (model.moe.group sequences) that a rank's micro-batch does not split into."""
    group = cfg.model.moe.group
    if not cfg.model.moe.enabled or group is None:
        return []
    micro = cfg.batch_layout(dims).micro_batch
    if micro % group:
        return [
            Problem.of(
                "model.moe.group",
                f"model.moe.group={group} sequences does not divide a micro-batch of {micro} sequences (global_batch / (dp x ep) / accumulation)",
                f"use a group that divides {micro}",
            )
        ]
    return []


def as_plan_keys(message: str) -> str:
    """A schedule refusal in the words of the config: parallel.pp, parallel.microbatches, parallel.chunks."""
    for flag, key in (("stages", "pp"), ("microbatches", "microbatches"), ("chunks", "chunks")):
        message = message.replace(f"--{flag} ", f"parallel.{key}=")
        message = re.sub(rf"(?<![\w.-]){flag}=", f"parallel.{key}=", message)
    return message


def launch_problems(cfg: Config, world: int, ckpt: Path | None) -> list[Problem]:
    """`problems`, and what only a launch needs: the corpus (tokenized once, here), the checkpoint to resume (every file
    verified), the run directory (writable, holding no other run), the weights and the disk (`behemoth.faults.preflight`)."""
    from behemoth.faults.checkpoint import read_meta, validate_checkpoint
    from behemoth.faults.preflight import environment_problems

    out = problems(cfg, world)
    try:
        problem = cfg.prepare_corpus(progress=cfg.run.progress).vocab_problem(cfg.model.vocab_size)
        if problem:
            out.append(Problem.of("model.vocab_size", *problem.split("; ", 1)))
    except BehemothError as err:
        out.append(Problem.from_error("data.path", err))
    if ckpt is not None:
        damaged = collect("--resume", validate_checkpoint, ckpt, cfg.model.model_dump(mode="json"))
        out += damaged
        step = None if damaged else read_meta(ckpt)["step"]
        if step is not None and step >= cfg.train.steps:
            out.append(
                Problem.of(
                    "train.steps",
                    f"checkpoint {ckpt} is at step {step} and train.steps={cfg.train.steps}",
                    f"raise train.steps above {step} to train further",
                )
            )
    out += environment_problems(cfg, resuming=ckpt is not None)
    if not out:  # the scratch directory and the disk space the offloaded states need
        out += offload_launch_problems(cfg, world)
    return out


def refuse(cfg: Config, world: int, ckpt: Path | None = None, *, launch: bool = False) -> None:
    """Raise `Refused` with every problem, if there is one (the edge of the program)."""
    found = launch_problems(cfg, world, ckpt) if launch else problems(cfg, world)
    if found:
        raise Refused(found)


def describe_plan(cfg: Config, world: int) -> str:
    """`pp=4 (1f1b, 8 micro-batches, blocks [0, 2, 4, 6, 8]) x dp=2 x tp=2` for the launch line."""
    from behemoth.parallel.pipeline.partition import balance_stages
    from behemoth.parallelize import planned_layer_costs

    plan, dims = cfg.parallel, cfg.parallel.dims(world)
    degrees = f"dp={dims.dp}" + (f" x ep={dims.ep}" if dims.ep > 1 else "") + (f" x tp={dims.tp}" if dims.tp > 1 else "")
    side = math.isqrt(dims.tp // plan.tp_depth)
    degrees += f" (2-D: a {side} x {side} grid)" if dims.tp > 1 and plan.tp_mode == "2d" else ""
    degrees += f" (2.5-D: {plan.tp_depth} x {side} x {side})" if dims.tp > 1 and plan.tp_mode == "2.5d" else ""
    degrees += f" (3-D: a {round(dims.tp ** (1 / 3))}^3 cube)" if dims.tp > 1 and plan.tp_mode == "3d" else ""
    if dims.cp > 1:
        heads = heads_per_rank(model_shape(cfg.model, cfg.hf).n_head, dims.tp, plan.tp_mode, plan.tp_depth)
        degrees += f" x cp={dims.cp} ({context_mode(plan.cp_mode, heads, dims.cp)})"
    if plan.burst is not None:  # every layer at its own width over the job (parallel/burst)
        return f"burst (layer widths {list(plan.burst)})"
    if plan.pp == 1:
        return degrees
    if plan.stage_boundaries is not None:
        bounds: Any = f"blocks {list(plan.stage_boundaries)}"
    elif plan.balance == "time":
        bounds = "blocks measured at start"
    else:
        bounds = f"blocks {balance_stages(planned_layer_costs(plan, model_shape(cfg.model, cfg.hf), cfg.seq_len), plan.num_stages)}"
    return f"pp={plan.pp} ({plan.schedule}, {cfg.batch_layout(dims).accum} micro-batches, {bounds}) x {degrees}"
