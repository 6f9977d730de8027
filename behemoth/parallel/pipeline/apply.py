"""apply_pipeline: keep this rank's stages of the model; what a pipeline adds to the engine's step.

`apply_pipeline` is the first transform on the meta model: it builds the schedule, cuts the module
tree down to this rank's stages and decides whether this rank recomputes activations. Once the
parameters exist and their gradient syncs are attached, `start` builds the executor. The engine then
runs every step: the executor's passes and transfers (`run`), and the engine's own end of the step,
into which the pipeline adds two things:

- with tied embeddings, the first and last stages hold copies of the embedding's weight; their
  gradients are summed (`sum_tied_grads`) before the data-parallel reduction (sums commute, and ZeRO
  keeps only shards after it);
- the clipping norm counts each parameter on one pipeline rank only (`counts`): a tied weight on its
  first stage, a Chimera stage on its first replica.

Chimera's two replicas of a stage sum their gradients inside the schedule (GRAD_SYNC). The V schedules (zbv,
dualpipev) hold stages r and 2p-1-r, so rank 0 holds both ends and a tied embedding needs no exchange; 1f1b-scp
recomputes through its own RECOMPUTE passes, so its blocks are not checkpointed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from behemoth.comm import CommMeter, pair_all_reduce
from behemoth.errors import BehemothError
from behemoth.models.layered import LayeredView
from behemoth.parallel.deferred import make_deferrable
from behemoth.parallel.pipeline.analysis.simulate import peak_stash
from behemoth.parallel.pipeline.executor import SYNC_TAG, Activations, Autocast, Batch, LossFn, PipeComm, PipelineExecutor, StepTrace
from behemoth.parallel.pipeline.partition import PipelineStage, cut_model
from behemoth.parallel.pipeline.schedules import Schedule, build_schedule
from behemoth.parallel.recompute import RecomputePolicy, recompute_ranks

TIED_TAG = SYNC_TAG - 1  # the tied-embedding exchange between the first and last stage


@dataclass(frozen=True)
class PipelinePolicy:
    """A pipeline as a plan states it, with its stage boundaries resolved."""

    schedule: str
    microbatches: int  # per step and data-parallel rank
    boundaries: tuple[int, ...]  # first block of every stage, then n_layer
    chunks: int = 1  # model chunks per rank (the interleaved schedule's v)
    recompute: RecomputePolicy = "none"
    seq_split: int = 1  # sequence parallelism: stages exchange 1/seq_split of the sequence
    timeout_s: float = 300.0


class PipelineParallel:
    """This rank's part of the pipeline: the schedule, its pipeline stages of the cut model, the executor."""

    def __init__(
        self,
        model: nn.Module,
        group: dist.ProcessGroup,
        policy: PipelinePolicy,
        layers: LayeredView,
        *,
        tied: bool,
        transposed: frozenset[str] = frozenset(),
        streamed: bool = False,
    ) -> None:
        self.model, self.group, self.policy, self.layers, self.tied = model, group, policy, layers, tied
        self.streamed = streamed  # stages streamed by offload: their executor sums a tied embedding's shards itself
        self.rank = dist.get_rank(group)
        self.schedule: Schedule = build_schedule(policy.schedule, dist.get_world_size(group), policy.microbatches, policy.chunks)
        self.bounds = list(policy.boundaries)
        self.stages = cut_model(model, self.schedule.chunk_stages[self.rank], self.bounds, layers, tied, streamed=streamed)
        self.transposed = transposed
        for stage in self.stages.values():
            stage.seq_split = policy.seq_split
        self.recomputes = self.rank in recompute_ranks(policy.recompute, peak_stash(self.schedule))
        if policy.schedule == "1f1b-scp":  # its RECOMPUTE passes recompute whole stages; no block is checkpointed as well
            check_scp_recompute(policy.recompute)
            self.recomputes = False
        self.executor: PipelineExecutor | None = None
        self.last_trace: StepTrace | None = None
        self.meter: CommMeter | None = None

    def stage_parameters(self) -> dict[int, list[nn.Parameter]]:
        """Stage -> the parameters its passes use, which ZeRO buckets per stage. The tied embedding shared with another
        rank is left out: ZeRO reduces it at the step, after the two stages summed it."""
        return stage_parameters(self.model, self.stages, self.layers, shared=self._tied_peer() is not None)

    def start(
        self,
        *,
        hidden_size: int,
        device: torch.device,
        on_grads: list,
        meter: CommMeter | None = None,
        batch_split: int = 1,
        static_stash: bool = False,
    ) -> None:
        """Build the executor over the materialized parameters; `on_grads`: what to tell when a stage's gradients exist;
        `hidden_size` and `batch_split`: this rank's block of an activation (2-D/3-D tp: features / q, sequences / rows);
        `static_stash`: a stage's forward saves the same bytes for every input of one shape (no routing), so the executor
        counts them once per (stage, shape) instead of hooking every saved tensor of every pass."""
        self.meter = meter
        dtype = next(self.model.parameters()).dtype
        # a split backward defers the linear layers' weight-gradient matmuls (tensor-parallel ones too) to its W passes
        deferral = make_deferrable(self.model, self.transposed) if self.schedule.split_backward else None
        self.executor = PipelineExecutor(
            self.schedule,
            self.rank,
            self.stages,
            PipeComm(self.group, self.policy.timeout_s, meter),
            Activations(hidden_size, dtype, device, self.policy.seq_split, batch_split),
            replica_params=self._replica_params(),
            on_grads=(lambda stage: [f(stage) for f in on_grads]) if on_grads else None,
            deferral=deferral,
            static_stash=static_stash,
        )
        self.executor.stash_meter.exclude(list(self.model.parameters()))

    def run(self, micro_batches: Batch, loss: LossFn, autocast: Autocast = contextlib.nullcontext) -> torch.Tensor:
        """One step's passes through the schedule; this rank's share of the loss (its last stages' micro-batches)."""
        self.last_trace = self.executor.run(micro_batches, loss, autocast)
        return self.last_trace.loss

    def forward_only(self, batches: Batch, loss_sum: LossFn, autocast: Autocast = contextlib.nullcontext) -> torch.Tensor:
        """[summed token loss, token count] of the batches whose last stage runs on this rank."""
        return self.executor.forward_only(batches, loss_sum, autocast)

    def _replica_params(self) -> dict[int, list[nn.Parameter]]:
        """Stage -> the parameters its GRAD_SYNC sums (Chimera); a parameter two local stages share goes with the first."""
        if len(self.schedule.stage_ranks[0]) == 1:
            return {}
        seen: set[int] = set()
        out: dict[int, list[nn.Parameter]] = {}
        for stage in sorted(self.stages):
            out[stage] = [p for _, p in sorted(self.stages[stage].named_parameters(), key=lambda np: np[0]) if id(p) not in seen]
            seen.update(id(p) for p in out[stage])
        return out

    def _tied_peer(self) -> int | None:
        """The rank whose copy of the tied embedding this rank's must be summed with, if any."""
        return tied_peer(self.schedule, self.rank, self.tied)

    def sum_tied_grads(self) -> None:
        """Sum the first and last stages' copies of a tied embedding's gradient (before the data-parallel reduction; a
        streamed pipeline's stages sum their copies' shards in their step, offload/stage_tied.py)."""
        peer = self._tied_peer()
        if peer is not None and not self.streamed:
            grad = self.model.get_submodule(self.layers.embedding).weight.grad
            pair_all_reduce(grad, peer, self.group, self.meter, tag=TIED_TAG, timeout_s=self.policy.timeout_s)

    def counts(self, name: str) -> bool:
        """Whether this rank counts parameter `name` in the global gradient norm: on the first replica of the lowest
        stage that uses it (the embedding's is stage 0 even when the head shares it)."""
        return self.schedule.stage_ranks[self._lowest_stage(name)][0] == self.rank

    def _lowest_stage(self, name: str) -> int:
        blocks, bounds = self.layers.blocks, self.bounds
        if name.startswith(blocks + "."):
            block = int(name[len(blocks) + 1 :].split(".")[0])
            return next(s for s in range(len(bounds) - 1) if bounds[s] <= block < bounds[s + 1])
        return 0 if name.startswith(tuple(f"{m}." for m in self.layers.first)) else len(bounds) - 2


def check_scp_recompute(recompute: RecomputePolicy) -> None:
    """1f1b-scp decides which micro-batches recompute; a policy naming ranks or `early` would be silently overridden."""
    if recompute not in ("none", "full"):
        raise BehemothError(
            f"parallel.recompute={recompute!r} with parallel.schedule=1f1b-scp: the schedule itself picks what recomputes",
            "leave parallel.recompute unset (or full), or use parallel.schedule=1f1b with it",
        )


def tied_peer(schedule: Schedule, rank: int, tied: bool) -> int | None:
    """The rank whose copy of a tied embedding rank `rank`'s is summed with, if any (pure: the planner asks it too)."""
    if not tied or len(schedule.stage_ranks[0]) > 1:  # Chimera's GRAD_SYNC covers both copies
        return None
    first, last = schedule.stage_ranks[0][0], schedule.stage_ranks[-1][0]
    if first == last or rank not in (first, last):
        return None
    return last if rank == first else first


def stage_parameters(model: nn.Module, stages: dict[int, PipelineStage], layers: LayeredView, *, shared: bool) -> dict[int, list[nn.Parameter]]:
    """Stage -> the parameters its passes use, less the tied embedding when it is `shared` with another rank."""
    tied = model.get_submodule(layers.embedding).weight if shared else None
    return {stage: [p for p in part.parameters() if p is not tied] for stage, part in stages.items()}


def apply_pipeline(
    model: nn.Module,
    group: dist.ProcessGroup,
    policy: PipelinePolicy,
    *,
    layers: LayeredView,
    tied: bool = False,
    transposed: frozenset[str] = frozenset(),
    streamed: bool = False,
) -> PipelineParallel:
    """Cut `model` (on the meta device) down to this rank's pipeline stages of `policy`'s schedule; `transposed` names
    the linear layers that hold an [in, out] weight (their gradients are deferred too under a split backward);
    `streamed`: offload streams the stages' units."""
    return PipelineParallel(model, group, policy, layers, tied=tied, transposed=transposed, streamed=streamed)
