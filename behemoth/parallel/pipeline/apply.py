"""apply_pipeline: keep this rank's stages of the model, and train them through the executor.

`check_pipeline` refuses, before any worker starts, a plan that cannot run (more stages than
blocks, micro-batches the schedule cannot use, an odd Chimera depth, bad stage boundaries).
`apply_pipeline` is the first transform on the meta model: it builds the schedule, resolves the
stage boundaries, cuts the module tree down to this rank's stages and decides whether this rank
recomputes activations. `PipelineParallel.attach` then wires the executor to the materialized
parameters, the data-parallel gradient sync and the optimizer.

Gradients: the last stage's loss is divided by the global token count, micro-batch gradients
accumulate locally, Chimera's two replicas of a stage sum theirs (GRAD_SYNC), data-parallel
replicas sum theirs (the engine's sync), and with tied embeddings the first and last stages sum
their copies of `wte.weight`. The clipping norm counts every parameter once over the pipeline.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from behemoth.comm import all_reduce, pair_all_reduce
from behemoth.errors import BehemothError
from torch import nn
from behemoth.parallel.clip import clip_grad_norm
from behemoth.parallel.pipeline.executor import SYNC_TAG, PipelineExecutor, StepTrace
from behemoth.parallel.pipeline.partition import (
    balance_stages, check_stage_boundaries, cut_model, estimate_layer_costs, measure_layer_costs, uniform_layer_costs,
)
from behemoth.parallel.pipeline.schedules import Schedule, ScheduleError, build_schedule, check_request
from behemoth.parallel.pipeline.simulate import peak_stash
from behemoth.parallel.pipeline.views import LayeredView, view_of
from behemoth.parallel.recompute import recompute_ranks
from behemoth.parallel.tensor.grads import grad_slices, sharded_over
from behemoth.topology import ParallelDims, Runtime

if TYPE_CHECKING:
    from behemoth.config import Config
    from behemoth.engine import Engine

TIED_TAG = SYNC_TAG - 1  # the tied-embedding exchange between the first and last stage


def pipeline_microbatches(cfg: Config, dp: int) -> int:
    """Micro-batches per step on each data-parallel rank (the pipeline's m)."""
    return cfg.batch_layout(dp).accum


def _as_plan_keys(message: str) -> str:
    """A schedule refusal in the words of the config: parallel.pp, parallel.microbatches, parallel.chunks."""
    for flag, key in (("stages", "pp"), ("microbatches", "microbatches"), ("chunks", "chunks")):
        message = message.replace(f"--{flag} ", f"parallel.{key}=")
        message = re.sub(rf"(?<![\w.-]){flag}=", f"parallel.{key}=", message)
    return message


def check_pipeline(cfg: Config, dims: ParallelDims) -> None:
    """Refuse before launch a pipeline plan that cannot run; one line naming value, constraint and fix."""
    plan, n_layer = cfg.parallel, cfg.model.n_layer
    recompute_ranks(plan.recompute, [1] * plan.pp)  # rank lists name existing ranks
    if plan.pp == 1:
        if plan.stage_boundaries is not None:
            check_stage_boundaries(plan.stage_boundaries, n_layer, 1)
        return
    stages = plan.num_stages
    if stages > n_layer:
        times = f" x parallel.chunks={plan.chunks}" if plan.schedule_chunks > 1 else ""
        raise BehemothError(f"parallel.pp={plan.pp}{times} makes {stages} pipeline stages but model.n_layer={n_layer}: "
                            "every stage needs at least one block", f"use at most {n_layer} stages or a deeper model")
    view_of(cfg.hf.arch)  # a model family the pipeline can cut
    if plan.balance == "time" and cfg.hf.arch and plan.stage_boundaries is None:
        raise BehemothError(f"parallel.balance=time times behemoth's GPT layers, not hf.arch={cfg.hf.arch}'s",
                            "use parallel.balance=flops or layers, or set parallel.stage_boundaries")
    try:
        check_request(plan.schedule, plan.pp, pipeline_microbatches(cfg, dims.dp), plan.schedule_chunks)
    except ScheduleError as err:
        raise BehemothError(_as_plan_keys(str(err))) from None
    if plan.stage_boundaries is not None:
        check_stage_boundaries(plan.stage_boundaries, n_layer, stages)


def resolve_stage_boundaries(cfg: Config, rt: Runtime | None = None) -> list[int]:
    """The plan's boundaries, or ones balanced by the plan's cost measure (measured ones on rank 0, broadcast)."""
    plan, model = cfg.parallel, cfg.model
    if plan.stage_boundaries is not None:
        check_stage_boundaries(plan.stage_boundaries, model.n_layer, plan.num_stages)
        return list(plan.stage_boundaries)
    if plan.balance == "layers":
        costs = uniform_layer_costs(model)
    elif plan.balance == "flops" or rt is None:
        hf = cfg.hf
        costs = estimate_layer_costs(model, cfg.seq_len, ffn=hf.ffn, gated=hf.arch == "llama",
                                     kv_heads=hf.kv_heads if hf.arch == "llama" else None)
    else:
        size = cfg.batch_layout(rt.dims.dp).micro_batch
        box: list[Any] = [measure_layer_costs(model, cfg.seq_len, size, rt.device) if rt.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)  # every rank must cut at the same places
        costs = box[0]
    return balance_stages(costs, plan.num_stages)


def describe_pipeline(cfg: Config, dims: ParallelDims) -> str:
    """`pp=4 (1f1b, 8 micro-batches, blocks [0, 2, 4, 6, 8]) x ` for the launch line; empty without a pipeline."""
    plan = cfg.parallel
    if plan.pp == 1:
        return ""
    bounds = "measured at start" if plan.balance == "time" and plan.stage_boundaries is None else f"blocks {resolve_stage_boundaries(cfg)}"
    return f"pp={plan.pp} ({plan.schedule}, {pipeline_microbatches(cfg, dims.dp)} micro-batches, {bounds}) x "


def _canonical_stage(name: str, bounds: list[int], view: LayeredView) -> int:
    """The lowest stage that uses parameter `name` (the embedding's is 0 even when the head shares it)."""
    if name.startswith(view.blocks + "."):
        block = int(name[len(view.blocks) + 1:].split(".")[0])
        return next(s for s in range(len(bounds) - 1) if bounds[s] <= block < bounds[s + 1])
    return 0 if name.startswith(tuple(f"{m}." for m in view.first)) else len(bounds) - 2


class PipelineParallel:
    """This rank's part of the pipeline: schedule, stage chunks of the cut model, executor."""

    def __init__(self, model: nn.Module, cfg: Config, rt: Runtime) -> None:
        plan = cfg.parallel
        self.cfg, self.rt, self.model, self.view = cfg, rt, model, view_of(cfg.hf.arch)
        self.rank, self.group = rt.coordinate("pp"), rt.group("pp")
        self.schedule: Schedule = build_schedule(plan.schedule, plan.pp, pipeline_microbatches(cfg, rt.dims.dp), plan.schedule_chunks)
        self.bounds = resolve_stage_boundaries(cfg, rt)
        self.chunks = cut_model(model, self.schedule.chunk_stages[self.rank], self.bounds, self.view, cfg.model.tie_embeddings)
        self.seq_split = plan.tp if plan.sequence_parallel else 1  # SP: stages exchange [B, T/tp, d], each tp rank its chunk
        for chunk in self.chunks.values():
            chunk.seq_split = self.seq_split
        self.recomputes = self.rank in recompute_ranks(plan.recompute, peak_stash(self.schedule))
        self.executor: PipelineExecutor | None = None
        self.last_trace: StepTrace | None = None
        self._lr, self._grad_norm = 0.0, 0.0

    def stage_parameters(self) -> dict[int, list[nn.Parameter]]:
        """Stage -> the parameters its passes use, which ZeRO buckets per stage (see `Zero`). The tied embedding
        shared with another rank is left out: ZeRO reduces it at the optimizer step, after the two stages summed it."""
        tied = self.model.get_submodule(self.view.embedding).weight if self._tied_peer() is not None else None
        return {stage: [p for p in chunk.parameters() if p is not tied] for stage, chunk in self.chunks.items()}

    def attach(self, engine: Engine) -> None:
        """Wire the executor to the materialized parameters, the gradient sync and the optimizer."""
        self.engine = engine
        named = list(self.model.named_parameters())
        self.executor = PipelineExecutor(
            self.schedule, self.rank, self.chunks, group=self.group, hidden_size=self.cfg.model.d_model,
            dtype=named[0][1].dtype, device=self.rt.device, tokens_per_step=engine.tokens_per_step,
            timeout_s=self.cfg.run.timeout_s, on_opt_step=self._optimizer_step, sync_params=self._replica_sync_params(),
            meter=engine.meter, autocast=engine.autocast, loss_fn=engine.loss_fn,
            seq_split=self.seq_split, on_grads=getattr(engine.sync, "reduce_chunk", None))
        self.executor.stash_meter.exclude([p for _, p in named])

    def _replica_sync_params(self) -> dict[int, list[torch.nn.Parameter]]:
        """Stage -> the parameters its GRAD_SYNC sums (Chimera); a parameter two local stages share goes with the first."""
        if len(self.schedule.stage_ranks[0]) == 1:
            return {}
        seen: set[int] = set()
        out: dict[int, list[torch.nn.Parameter]] = {}
        for stage in sorted(self.chunks):
            out[stage] = [p for _, p in sorted(self.chunks[stage].named_parameters(), key=lambda np: np[0]) if id(p) not in seen]
            seen.update(id(p) for p in out[stage])
        return out

    def _tied_peer(self) -> int | None:
        """The rank whose copy of the tied embedding this rank's must be summed with, if any."""
        s = self.schedule
        if not self.cfg.model.tie_embeddings or len(s.stage_ranks[0]) > 1:  # Chimera's GRAD_SYNC covers both copies
            return None
        first, last = s.stage_ranks[0][0], s.stage_ranks[-1][0]
        if first == last or self.rank not in (first, last):
            return None
        return last if self.rank == first else first

    def _optimizer_step(self) -> None:
        """OPT_STEP: sum tied embedding copies, finish the data-parallel (or ZeRO) reduction, clip over the pipeline, step."""
        engine = self.engine
        peer = self._tied_peer()
        if peer is not None:  # on the local sums, before the dp reduction (sums commute; ZeRO keeps only shards after it)
            pair_all_reduce(self.model.get_submodule(self.view.embedding).weight.grad, peer, self.group, engine.meter, tag=TIED_TAG, timeout_s=self.cfg.run.timeout_s)
        engine.sync.finish()
        if engine.tp is not None:
            engine.tp.finish_grads(engine.model, engine.sync)
        self._grad_norm = self._clip_grad_norm(self.cfg.train.grad_clip)
        for group in engine.optimizer.param_groups:
            group["lr"] = self._lr
        engine.optimizer.step()

    def _clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient norm of the single-process model: each parameter counted on one pipeline rank (a tied
        weight on its first stage), split parameters by every shard, replicated ones once, ZeRO shards summed."""
        engine, tp_size = self.engine, self.rt.dims.tp
        owner = lambda name: self.schedule.stage_ranks[_canonical_stage(name, self.bounds, self.view)][0] == self.rank  # noqa: E731
        return clip_grad_norm(grad_slices(engine.model, engine.sync), max_norm, meter=engine.meter, counted=owner,
                              groups=[sharded_over(engine.sync), self.rt.group("tp") if tp_size > 1 else None, self.group],
                              split=set(engine.tp.layouts) if engine.tp is not None else set(), tp_size=tp_size, device=self.rt.device)

    def train_step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> tuple[float, float]:
        """One optimizer step through the schedule; (loss over the global batch, gradient norm)."""
        self.engine.model.train()
        self.engine.sync.zero_grad()
        self.engine.sync.set_sync(False)  # the data-parallel sum runs once, at OPT_STEP
        self._lr = lr
        self.last_trace = self.executor.run(micro_batches)
        loss = self.last_trace.loss.clone()
        all_reduce(loss, self.group)
        all_reduce(loss, self.rt.group("dp"))
        return float(loss), self._grad_norm

    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean token loss over the batches, every stage running forward only."""
        self.engine.model.eval()
        stats = self.executor.forward_only(batches)
        all_reduce(stats, self.group)
        all_reduce(stats, self.rt.group("dp"))
        return float(stats[0] / stats[1])


def apply_pipeline(model: nn.Module, cfg: Config, rt: Runtime) -> PipelineParallel:
    """Cut `model` (on the meta device) down to this rank's pipeline stages."""
    check_pipeline(cfg, rt.dims)
    return PipelineParallel(model, cfg, rt)
