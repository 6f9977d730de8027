"""parallelize(lm, plan, runtime): a model laid out over the mesh with its gradient syncs, and no optimizer.

The result serves training (the engine builds the optimizer on top of its syncs) or, with `for_training=False`,
inference: no syncs, no gradient buffers, no recomputation, `requires_grad` off (`inference_model`).
Each dimension is applied by its own `apply_<dim>(model, group, policy)`, in this order (DESIGN.md):

1. pipeline cut, on the meta device: it decides which blocks, embedding and head this rank holds at all;
2. tensor / sequence parallelism, still on meta: split layers keep only this rank's part of each weight,
   marked so that materialize draws the full (seed, name) tensor and keeps that part;
3. expert parallelism, still on meta: each MoE layer keeps E / ep experts (under tp, a slice of each one's width) and
   gets a runner that moves its tokens over ep; after tp, because an expert's tp slice is cut from its ep part;
   then context parallelism (cp > 1): ring or Ulysses attention through the model's attention hook, no parameter
   changes (its ranks are summed with dp's: the syncs run over dp x cp);
4. activation recomputation: wraps block forwards in place, names unchanged (under a pipeline, per rank);
5. ZeRO-3's sharding, still on meta: every parameter cut to this rank's 1-D piece, so materialize draws only that;
6. materialize: every kept parameter drawn from (seed, name), or loaded from the model's weights;
7. data parallelism or ZeRO 1-3: they attach to the real gradients of the real parameters, so they come last. With
   experts, dense parameters are synchronised over dp x ep (every rank of it holds them, and sees other tokens),
   expert parameters over dp (the ranks holding the same experts): two syncs, or two kinds of ZeRO-3 unit.

With offload (`offload=` a policy), steps 5-7 are the offload runtime's: ZeRO-3's units are cut on meta as in
step 5, then each unit is drawn (or loaded) one at a time straight onto its tier, never the whole model in memory,
the runtime is the model's gradient sync, and its streamer is the model's executor. It recomputes every block from its
kept input by itself, so step 4 is skipped.

Transforms that change which parameters a rank holds come first, on meta, so nothing is allocated for
parameters this rank will not keep.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from behemoth.comm import CommMeter, all_reduce, broadcast_object
from behemoth.data import BatchLayout
from behemoth.errors import BehemothError
from behemoth.models.causal_lm import CausalLM, summed_token_loss
from behemoth.models.init import materialize
from behemoth.models.lora import inject_lora, quantize_base
from behemoth.models.shape import LayerCosts, layer_flops, uniform_layer_costs
from behemoth.offload import OffloadPolicy, StreamedSteps, apply_offload
from behemoth.offload.budget import ActivationShape
from behemoth.offload.stage_stream import StageStreams
from behemoth.parallel.burst import BurstGroups, BurstModel
from behemoth.parallel.burst.train import BurstSteps, burst_syncs
from behemoth.parallel.clip import clip_coefficient, clip_grad_norm
from behemoth.parallel.compile import apply_compile
from behemoth.parallel.context import ContextParallel, ContextPolicy, apply_context_parallel, heads_per_rank, resolve_mode
from behemoth.parallel.data import DataParallelPolicy, apply_data_parallel
from behemoth.parallel.executor import Executor, MicroBatchLoop, PipelineSteps
from behemoth.parallel.expert import EPComm, ExpertParallel, ExpertPolicy, apply_expert_parallel
from behemoth.parallel.expert.adapt import ExpertAdapter, build_adapter
from behemoth.parallel.expert.comm import two_level_groups
from behemoth.parallel.pipeline.apply import PipelineParallel, PipelinePolicy, apply_pipeline
from behemoth.parallel.pipeline.partition import balance_stages
from behemoth.parallel.recompute import apply_recompute, recompute_ranks
from behemoth.parallel.sync import GradSync
from behemoth.parallel.tensor import TensorParallel, TensorPolicy, TPComm, apply_tensor_parallel
from behemoth.parallel.tensor.cube import cube_of
from behemoth.parallel.tensor.subbatch import apply_subbatches
from behemoth.parallel.tensor.threed import TensorParallel3D, apply_tensor_parallel_3d
from behemoth.parallel.tensor.twod import TensorParallel2D, apply_tensor_parallel_2d, grid_of
from behemoth.parallel.zero import ExpertUnits, ZeroPolicy, apply_zero, shard_parameters, shards_nothing
from behemoth.plan import ParallelPlan
from behemoth.topology import MESH_DIMS, Runtime

GradTerms = list[tuple[torch.Tensor, float]]


@dataclass
class ParallelModel:
    """This rank's part of a model under a plan: the module, its pipeline and tensor-parallel parts, its syncs, and the
    executor that runs a step's micro-batches through it (parallel/executor.py)."""

    lm: CausalLM
    rt: Runtime
    syncs: list[GradSync]
    pipeline: PipelineParallel | None = None
    tp: TensorParallel | TensorParallel2D | TensorParallel3D | None = None
    meter: CommMeter = field(default_factory=CommMeter)
    experts: ExpertParallel | None = None
    adapter: ExpertAdapter | None = None
    executor: Executor | None = None  # None: the plain micro-batch loop (or the pipeline's, under one)
    context: ContextParallel | None = None  # cp > 1: each sequence's tokens split over the cp ranks

    def __post_init__(self) -> None:
        if self.executor is None and self.context is not None:
            self.executor = self.context.executor(self.lm, self.syncs, self.rt.device, self.pipeline)
        if self.executor is None:
            self.executor = (
                PipelineSteps(self.pipeline, self.syncs) if self.pipeline is not None else MicroBatchLoop(self.lm, self.syncs, self.rt.device)
            )

    @property
    def module(self) -> nn.Module:
        return self.lm.module

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token loss; vocabulary-parallel when the head is split (each rank holds 1/t of the logits)."""
        return summed_token_loss(logits, targets) if self.tp is None else self.tp.cross_entropy_sum(logits, targets)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        """The model's logits (this rank's vocabulary shard under TP); a pipeline runs stage by stage instead."""
        return self.executor.logits([idx])[0]

    def reduce_over_batch(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a per-rank quantity of the batch (a loss, token counts) over the ranks that see different parts of it:
        the pipeline (only last stages hold losses), the data-parallel replicas and the context-parallel ranks (each holds
        part of every sequence). (Reporting, not model traffic: unmetered.)"""
        return self.start_reduce_over_batch(t)()

    def start_reduce_over_batch(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """`reduce_over_batch` begun now and finished by calling the result: the first of its groups with more than one rank
        reduces in the background meanwhile (the step's loss travels while gradients are clipped and the optimizers step);
        every rank must start and finish it at the same points. The sum is the same as `reduce_over_batch`'s."""
        groups = [g for g in (self.rt.group(name) for name in ("pp", "dp", "cp", "ep")) if dist.get_world_size(g) > 1]
        first = all_reduce(t, groups[0], async_op=True) if groups else None

        def finish() -> torch.Tensor:
            if first is not None:
                first.wait()
            for group in groups[1:]:
                all_reduce(t, group)
            return t

        return finish

    def router_metrics(self) -> dict[str, Any]:
        """The step's auxiliary losses and expert usage (MoE models; empty otherwise), summed over every rank holding a
        part of them: pipeline stages hold different layers, dp x ep ranks see different tokens (tp ranks repeat them)."""
        routers = self.lm.routers
        if routers is None:
            return {}
        flat = self.reduce_over_batch(routers.packed(self.rt.device))
        return routers.summary(flat)

    def grad_slices(self) -> list[tuple[str, torch.Tensor]]:
        return [s for sync in self.syncs for s in sync.grad_slices()]

    def finish_grads(self) -> None:
        """After the last backward: pipeline copies summed, every sync finished, sequence-parallel partial sums summed."""
        if self.pipeline is not None:
            self.pipeline.sum_tied_grads()
        for sync in self.syncs:
            sync.finish()
        if self.tp is not None:  # gradients kept on a tier (offload) were summed unit by unit, as each completed
            self.tp.finish_grads(self.grad_slices())

    def grad_norm_terms(self) -> tuple[GradTerms, dist.ProcessGroup | None]:
        """Every gradient piece this rank holds with the weight of its square in the global norm (1 / the ranks holding
        an identical copy; 0 where another pipeline rank counts it), and the group to sum over (None: fully replicated)."""
        if self.pipeline is None and self.tp is None and all(s.replicas == self.rt.world_size for s in self.syncs):
            return [(g, 1.0) for _, g in self.grad_slices()], None
        terms = []
        for sync in self.syncs:
            for name, g in sync.grad_slices():
                copies = sync.replicas * self.tp_copies(name)
                counted = self.pipeline is None or self.pipeline.counts(name)
                terms.append((g, 1.0 / copies if counted else 0.0))
        return terms, self.rt.world_group

    def tp_copies(self, name: str) -> int:
        return gradient_copies(self.tp, self.experts, name)

    def clip_grads(self, max_norm: float, device: torch.device) -> float:
        """The global gradient norm, every gradient scaled by max_norm / norm when that is below 1 (gradients a sync keeps
        on a tier: at each unit's step)."""
        terms, group = self.grad_norm_terms()
        held = tuple(sq for sync in self.syncs if (sq := sync.held_grad_square()) is not None)
        norm = clip_grad_norm(terms, max_norm, group=group, meter=self.meter, device=device, squares=held)
        for sync in self.syncs:
            sync.clip_held_grads(float(clip_coefficient(norm, max_norm)), max_norm)
        return norm

    def step_metrics(self) -> dict[str, Any]:
        """The step's measurements: an MoE's losses and expert usage, a sync's own (offload's bytes per tier)."""
        out = self.router_metrics()
        for sync in self.syncs:
            out |= sync.step_metrics()
        return out

    def close(self) -> None:
        """Release what outlives a step (offload's I/O threads and scratch directory)."""
        for sync in self.syncs:
            sync.close()

    def model_state(self) -> dict[str, Any]:
        """Parameters (or this rank's shards of them) by single-process name, for DCP."""
        return {name: t for sync in self.syncs for name, t in sync.model_state().items()}

    def measure_buffers(self) -> None:
        """Count the peaks of short-lived buffers (ZeRO's gathered parameters and gradient buckets) from now on; they
        appear in `state_bytes` after the next step. Off until asked: counting waits for collectives to let go."""
        for sync in self.syncs:
            sync.measure_buffers()

    def state_bytes(self) -> dict[str, int]:
        """Bytes of the syncs' parameters and gradients, and of the parameters no sync holds (a frozen LoRA base)."""
        out: dict[str, int] = {}
        for sync in self.syncs:
            for key, n in sync.state_bytes().items():
                out[key] = out.get(key, 0) + n
        frozen = {
            p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in self.lm.module.parameters() if not p.requires_grad and p.numel()
        }
        out["params"] = out.get("params", 0) + sum(frozen.values())
        return out

    def checkpoint_views(self, state: dict[str, Any]) -> dict[str, Any]:
        """Split tensors as full-shape views, so DCP reshards to any tp or ep degree and export consolidates."""
        state = self.tp.checkpoint_views(state) if self.tp is not None else state
        return self.experts.checkpoint_views(state) if self.experts is not None else state


def gradient_copies(tp: TensorParallel | None, experts: ExpertParallel | None, name: str) -> int:
    """tp ranks holding an identical copy of this parameter's gradient piece (an expert's, per its own split): the weight
    of its square in the clipping norm is 1 / that, in memory and on offload's tiers alike."""
    if tp is None:
        return 1
    return experts.copies(name) if experts is not None and experts.is_expert(name) else tp.copies(name)


def resolve_stage_boundaries(plan: ParallelPlan, lm: CausalLM, seq_len: int, micro_batch: int, rt: Runtime | None = None) -> list[int]:
    """The plan's boundaries, or ones balanced by its cost measure (time: measured on the job's rank 0, broadcast)."""
    if plan.stage_boundaries is not None:
        return list(plan.stage_boundaries)
    if plan.balance == "time" and rt is not None:
        costs = broadcast_object(lambda: lm.time_layers(seq_len, micro_batch, rt.device), rt.world_group, rt.rank == 0)
    else:
        costs = planned_layer_costs(plan, lm.shape, seq_len)
    return balance_stages(costs, plan.num_stages)


def planned_layer_costs(plan: ParallelPlan, shape: Any, seq_len: int) -> LayerCosts:
    """Layer costs known before launch: block counts, or FLOPs (what `balance=time` measures is estimated by FLOPs)."""
    return uniform_layer_costs(shape) if plan.balance == "layers" else layer_flops(shape, seq_len)


def build_syncs(
    model: nn.Module,
    plan: ParallelPlan,
    rt: Runtime,
    *,
    units: Any,
    pipeline: PipelineParallel | None,
    meter: CommMeter,
    experts: ExpertParallel | None = None,
    optimizer_tier: str = "device",
) -> list[GradSync]:
    """Replicated data parallelism (zero_stage 0) or ZeRO 1-3, for every parameter: over dp, or with ep > 1 dense
    parameters over dp x cp x ep and expert parameters over dp x cp (two syncs; ZeRO-3 gives each kind of unit its group);
    `optimizer_tier`: where ZeRO-1/2 keep their moments (host: ZeRO-Offload)."""
    split = experts is not None and rt.dims.ep > 1
    kinds = (
        [(rt.data_group(), lambda n: not experts.is_expert(n)), (rt.expert_data_group(), experts.is_expert)] if split else [(rt.data_group(), None)]
    )
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}  # a LoRA base: no gradients, no optimizer state
    if plan.zero_stage == 0 or shards_nothing(plan.zero_stage, plan.param_dtype, optimizer_tier, max(dist.get_world_size(g) for g, _ in kinds)):
        return [apply_data_parallel(model, group, DataParallelPolicy(plan.bucket_mb), select=select, meter=meter) for group, select in kinds]
    if frozen and plan.zero_stage in (1, 2):
        kinds = [(group, lambda n, s=select: n not in frozen and (s is None or s(n))) for group, select in kinds]
    policy = ZeroPolicy(plan.zero_stage, plan.bucket_mb, plan.prefetch, plan.param_dtype, optimizer_tier)
    if plan.zero_stage == 3:  # a frozen base's units have no gradient: the adapters, whole, are all-reduced beside them
        adapters = [apply_data_parallel(model, kinds[0][0], DataParallelPolicy(plan.bucket_mb), meter=meter)] if frozen else []
        return [apply_zero(model, kinds[0][0], policy, units=units, meter=meter), *adapters]
    stage_params = pipeline.stage_parameters() if pipeline is not None else None
    return [apply_zero(model, group, policy, stage_params=stage_params, meter=meter, select=select) for group, select in kinds]


def apply_experts(lm: CausalLM, plan: ParallelPlan, rt: Runtime, meter: CommMeter, timeout_s: float) -> ExpertParallel | None:
    """Expert parallelism over ep for a model with MoE layers (at ep = 1 too: the runner then enters their tp region);
    an ep group spanning nodes gets its two-level all-to-all."""
    if not lm.moe_layers:
        return None
    tp = TPComm.of(rt.group("tp"), meter) if rt.dims.tp > 1 else None
    node_size = plan.expert_node_size or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    ep_groups = rt.mesh.mesh.movedim(MESH_DIMS.index("ep"), -1).reshape(-1, rt.dims.ep).tolist()
    whole_world = rt.world_size == dist.get_world_size()  # subgroups are created by every rank of the world
    levels = two_level_groups(ep_groups, node_size, dist.get_rank()) if rt.dims.ep > 1 and whole_world and plan.expert_a2a != "flat" else None
    if plan.expert_a2a == "2dh" and levels is None:
        raise BehemothError(
            f"parallel.expert_a2a=2dh: the ep={rt.dims.ep} group does not span several nodes of {node_size} ranks with several ranks on each",
            "use parallel.expert_a2a=auto or flat, or set parallel.expert_node_size to the ranks per node",
        )
    return apply_expert_parallel(
        lm.module,
        EPComm.of(rt.group("ep"), meter, timeout_s, levels),
        ExpertPolicy(plan.expert_layout, plan.expert_chunks),
        layers=lm.moe_layers,
        tp=tp,
        sequence_parallel=plan.sequence_parallel,
    )


def offload_activations(lm: CausalLM, batch: BatchLayout, seq_len: int, tp: int) -> ActivationShape:
    """What one rank's activations under offload depend on (its micro-batches, their size, the model's widths)."""
    shape = lm.shape
    return ActivationShape(batch.micro_batch, seq_len, shape.d_model, shape.ffn // tp, -(-shape.vocab_size // tp), shape.n_layer, batch.accum)


def inference_model(
    lm: CausalLM, rt: Runtime, pipeline: PipelineParallel | None, tp: TensorParallel | None, meter: CommMeter, experts: ExpertParallel | None
) -> ParallelModel:
    """The laid-out model for inference: no gradient syncs, no gradient buffers, no expert adapter, `requires_grad` off
    everywhere; nothing but the module references a parameter (quantization frees them). A pipeline gets its executor
    with nothing to tell of gradients: generation runs its forward-only pass (`flow`)."""
    for p in lm.module.parameters():
        p.requires_grad_(False)
    if pipeline is not None:
        pipeline.start(hidden_size=lm.shape.d_model, device=rt.device, on_grads=[], meter=meter)
    return ParallelModel(lm, rt, [], pipeline, tp, meter, experts)


def parallelize(
    lm: CausalLM,
    plan: ParallelPlan,
    rt: Runtime,
    *,
    batch: BatchLayout,
    seq_len: int,
    seed: int,
    timeout_s: float = 300.0,
    offload: OffloadPolicy | None = None,
    for_training: bool = True,
    lora: Any = None,
    compile: bool = False,
) -> ParallelModel:
    """Lay `lm` (on the meta device) out over `rt`'s mesh as `plan` says, in the order of the module docstring;
    with `offload`, its states go to the policy's tiers (steps 5-7 are the offload runtime's). `for_training=False`:
    for inference, steps 4 and 7 are skipped (`inference_model`). `lora` (finetune.lora): the base is frozen and adapters
    are added first, step 0, so every later transform splits, shards or stages them with the layer they adapt. `compile`
    (train.compile): each block's forward compiled, after step 4 (parallel/compile.py)."""
    if lora is not None and lora.enabled:
        inject_lora(lm, lora)
    model, meter = lm.module, CommMeter()
    optimizer_tier = "device"
    if offload is not None and offload.optimizer_only and plan.zero_stage in (1, 2):  # ZeRO-Offload: the ZeRO sync's moments on host
        optimizer_tier, offload = offload.optimizer, None
    pipeline = None
    if rt.dims.pp > 1:
        bounds = resolve_stage_boundaries(plan, lm, seq_len, batch.micro_batch, rt)
        policy = PipelinePolicy(
            plan.schedule, batch.accum, tuple(bounds), plan.schedule_chunks, plan.recompute, plan.tp if plan.sequence_parallel else 1, timeout_s
        )
        streamed = offload is not None and for_training  # offload streams the stages' units
        pipeline = apply_pipeline(model, rt.group("pp"), policy, layers=lm.layers, tied=lm.shape.tied, transposed=lm.transposed, streamed=streamed)
    tp: TensorParallel | TensorParallel2D | TensorParallel3D | None = None
    if rt.dims.tp > 1 and plan.tp_mode != "1d":
        tp = apply_2d(lm, rt, meter, for_training, plan)
    elif rt.dims.tp > 1:
        policy = TensorPolicy(lm.tp_plan, plan.sequence_parallel, lm.transposed, lm.norms)
        tp_comm = TPComm.of(rt.group("tp"), meter)
        tp = apply_tensor_parallel(model, tp_comm, policy)
        lm.after_tensor_parallel(rt.dims.tp)
        if plan.tp_subbatches > 1 and for_training:  # sub-pipelined blocks (Merak): parallel/tensor/subbatch.py
            apply_subbatches(model.get_submodule(lm.layers.blocks), tp_comm, plan.tp_subbatches)
    experts = apply_experts(lm, plan, rt, meter, timeout_s)
    context = apply_context(lm, plan, rt, meter, timeout_s) if for_training else None  # inference: cp ranks are replicas
    if offload is not None:
        if not for_training:
            raise ValueError("offload streams training's units: not for inference (inference/offload.py)")
        parts = (tp, experts, meter, pipeline, context)
        return offloaded_model(lm, plan, rt, offload, batch=batch, seq_len=seq_len, seed=seed, lora=lora, compile=compile, parts=parts)
    if for_training:
        recomputes = pipeline.recomputes if pipeline is not None else 0 in recompute_ranks(plan.recompute, [1])
        apply_recompute(model.get_submodule(lm.layers.blocks), recomputes)
        # then compiled block forwards (training only: cached decoding changes shapes every token), recomputation inside the
        # compiled region as torchtitan has it, so the compiler's partitioner recomputes (parallel/compile.py)
        apply_compile(model.get_submodule(lm.layers.blocks), compile)
    units = None
    if plan.zero_stage == 3 and for_training:  # inference holds its (tp/pp) part whole: nothing would gather a ZeRO-3 shard
        frozen = lora is not None and lora.enabled  # a LoRA base: only frozen parameters in units, adapters whole
        units = shard_parameters(
            model, rt.data_group(), layers=lm.layers, tie_embeddings=lm.shape.tied, experts=expert_units(experts, rt), frozen_only=frozen
        )
    materialize(model, seed=seed, device=rt.device, init_spec=lm.init_spec)
    lm.after_materialize(rt.device)
    if for_training and lora is not None and lora.enabled and lora.base_bits == 8:  # QLoRA-style: the loaded base in int8
        quantize_base(model, lm.layers.blocks)
    if not for_training:
        return inference_model(lm, rt, pipeline, tp, meter, experts)
    if plan.burst is not None:  # DeepPool's burst plan: layer by layer at each layer's width (parallel/burst/train.py)
        return burst_model(lm, plan.burst, rt, batch)
    syncs = build_syncs(model, plan, rt, units=units, pipeline=pipeline, meter=meter, experts=experts, optimizer_tier=optimizer_tier)
    if pipeline is not None:
        start_pipeline(pipeline, lm, tp, rt, syncs, meter)
    adapter = (
        build_adapter(experts, plan.expert_adapt, plan.expert_probe_every, rt.world_group, lm.moe_costs(), data_ranks=rt.dims.data_ranks)
        if experts
        else None
    )
    return ParallelModel(lm, rt, syncs, pipeline, tp, meter, experts, adapter, context=context)


def start_pipeline(pipeline: PipelineParallel, lm: CausalLM, tp: Any, rt: Runtime, syncs: list, meter: CommMeter) -> None:
    """The training pipeline's executor: stages exchange this rank's block of an activation (a 2-D/3-D tensor-parallel
    rank's features / q of its rows), tell the syncs when a stage's gradients exist, and count a stage's saved bytes once
    per shape unless a mixture of experts' routing changes them."""
    hidden, blocks = tp.activation_block(lm.shape.d_model) if isinstance(tp, TensorParallel2D | TensorParallel3D) else (lm.shape.d_model, 1)
    pipeline.start(
        hidden_size=hidden, device=rt.device, on_grads=[s.stage_done for s in syncs], meter=meter, batch_split=blocks, static_stash=lm.routers is None
    )


def offloaded_model(
    lm: CausalLM,
    plan: ParallelPlan,
    rt: Runtime,
    offload: OffloadPolicy,
    *,
    batch: BatchLayout,
    seq_len: int,
    seed: int,
    lora: Any,
    compile: bool,
    parts: tuple[TensorParallel | None, ExpertParallel | None, CommMeter, PipelineParallel | None, ContextParallel | None],
) -> ParallelModel:
    """Steps 5-7 of `parallelize` for a model whose states live on offload's tiers: ZeRO-3 units streamed by the offload
    runtime (tp, experts, the meter and the pipeline are the earlier steps' parts; under a pipeline each rank streams its
    own stages' units, offload/stage_stream.py; under cp each rank streams its shard of every sequence). A LoRA base
    streams read-only; its adapters stay resident and whole, synchronized as data parallelism does."""
    tp, experts, meter, pipeline, context = parts
    model = lm.module
    frozen = lora is not None and lora.enabled
    units = shard_parameters(
        model, rt.data_group(), layers=lm.layers, tie_embeddings=lm.shape.tied, experts=expert_units(experts, rt), frozen_only=frozen
    )
    apply_compile(model.get_submodule(lm.layers.blocks), compile)  # the streamer runs and recomputes the compiled forward
    copies = functools.partial(gradient_copies, tp, experts)  # an expert split over tp by its width: one copy, not tp
    activation = offload_activations(lm, batch, seq_len // rt.dims.cp, rt.dims.tp)  # cp: each rank's shard of the tokens
    sync = apply_offload(lm, units, rt, offload, seed=seed, tp=tp, copies=copies, meter=meter, activation=activation)
    adapters = []
    if frozen:
        materialize(model, seed=seed, device=rt.device, init_spec=lm.init_spec)  # what is left on the modules: the adapters
        adapters = [apply_data_parallel(model, rt.data_group(), DataParallelPolicy(plan.bucket_mb), meter=meter)]  # dp x cp
    if pipeline is not None:
        stages = StageStreams(sync, pipeline, hidden_size=lm.shape.d_model, meter=meter, context=context, others=adapters)
        return ParallelModel(lm, rt, [sync, *adapters], pipeline, tp, meter, experts, executor=stages)
    return ParallelModel(lm, rt, [sync, *adapters], None, tp, meter, experts, executor=StreamedSteps(sync, adapters, context))


def expert_units(experts: ExpertParallel | None, rt: Runtime) -> ExpertUnits | None:
    """Expert weights in units of their own over dp x cp (the ranks holding the same experts) when ep > 1; at ep = 1
    every rank holds every expert and a block's experts stay in its unit (over dp x cp, as the rest)."""
    return ExpertUnits(experts.is_expert, rt.expert_data_group()) if experts is not None and rt.dims.ep > 1 else None


def burst_model(lm: CausalLM, widths: list[int], rt: Runtime, batch: BatchLayout) -> ParallelModel:
    """A materialized model run as a burst plan: its executor and its sync (the only dimension it composes with is the
    job itself; planner/feasibility refuses the others before launch)."""
    burst = BurstModel(lm, widths, BurstGroups.of(widths, rt.world_group, rt.device), batch=batch.global_batch)
    syncs: list[GradSync] = list(burst_syncs(burst))  # this rank keeps only the parameters its layers use
    return ParallelModel(lm, rt, syncs, executor=BurstSteps(burst, syncs, rt.device))


def apply_2d(lm: CausalLM, rt: Runtime, meter: CommMeter, for_training: bool, plan: ParallelPlan) -> TensorParallel2D | TensorParallel3D:
    """2-D tensor parallelism (parallel.tp_mode=2d) over each tp group as a q x q grid, by the model's 2-D plan; 2.5-D
    (tp_mode=2.5d) as tp_depth such grids, each with its share of the batch; 3-D (tp_mode=3d) as a q x q x q cube. For
    inference only 2-D, every grid row running the whole batch: a request's keys and values then stay on the ranks of
    its heads' column whatever rows the scheduler's next batch puts it in."""
    mode, depth = plan.tp_mode, plan.tp_depth if plan.tp_mode == "2.5d" else 1
    layout = lm.tp3d_plan if mode == "3d" else lm.tp2d_plan
    if layout is None or (not for_training and mode != "2d") or rt.world_size != dist.get_world_size():
        raise BehemothError(
            f"parallel.tp_mode={mode} runs a model with a {mode} plan (planner/feasibility names them; inference: 2d only) "
            "in a job that is the whole world",
            "use tp_mode=1d here (generation loads a 2-D/3-D checkpoint in any layout)",
        )
    if mode == "3d":
        cube = cube_of(rt.mesh.mesh, MESH_DIMS.index("tp"), meter, plan.tp_regather)
        tp: TensorParallel2D | TensorParallel3D = apply_tensor_parallel_3d(lm.module, cube, layout)
    else:
        grid = grid_of(rt.mesh.mesh, MESH_DIMS.index("tp"), meter, depth, shared_batch=not for_training)
        tp = apply_tensor_parallel_2d(lm.module, grid, layout)
    lm.after_tensor_parallel(tp.grid.q)  # Gemma's embedding scale back on the replaced table; GPT-2's split_size h/q
    return tp


def apply_context(lm: CausalLM, plan: ParallelPlan, rt: Runtime, meter: CommMeter, timeout_s: float) -> ContextParallel | None:
    """Context parallelism (cp > 1): the model's attention by ring or Ulysses over cp, its data cut to this rank's tokens.
    No parameter changes, so it may come anywhere before the syncs; after tp, whose heads per rank Ulysses splits."""
    if rt.dims.cp == 1:
        return None
    mode = resolve_mode(plan.cp_mode, heads_per_rank(lm.shape.n_head, rt.dims.tp, plan.tp_mode, plan.tp_depth), rt.dims.cp)
    return apply_context_parallel(lm, rt.group("cp"), ContextPolicy(mode, timeout_s), meter)
