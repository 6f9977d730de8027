"""Offload under a pipeline: each pipeline rank streams its own stages' units, pass by pass, as its schedule runs them.

    steps = StageStreams(sync, pipeline, hidden_size=d_model, meter=meter)    # the model's executor (parallel/executor.py)
    loss = steps.run(micro_batches, loss_fn, autocast)

The schedule's actions run in their order, with the pipeline executor's own p2p groups, mailbox, bounded waits and
end-of-step checks (parallel/pipeline/executor.py); each compute pass is expanded into its stage's unit visits
(stage_order.py `stage_passes`) and those visits are run by the offload streamer (executor.py `Streamer.run`): a unit
is fetched (prefetched ahead, in plan order) and all-gathered before the visit that needs it, and evicted after the
last visit of its stay, its gradient reduce-scattered and written back (partial) or stepped (complete: fused, or
deferred to its next fetch). A forward pass keeps each block's input (activations at block boundaries) and sends the
stage's output; a backward pass recomputes each block from its kept input and sends the gradient of the stage's input.
Under a zero-bubble schedule (zb-h1, zbv, dualpipev) a split backward's input pass (BI) recomputes each block and
sends the gradient of the stage's input, keeping each block's input and output gradient; its weight pass (W) recomputes
each block again for its weight gradients, so a unit's gradient is reduced, stepped or written back after its last W
(a first stage's input pass is empty and its weight pass the full backward). 1f1b-scp's RECOMPUTE passes are empty
here: a streamed stage recomputes every block in its backward anyway. V-shaped schedules' two stages per rank are
streamed as interleaving's are, each pass visiting its own stage's units.
A later stage's first block reads the received activation as its kept input; the last stage's head computes the loss
and its backward at once (`FB`), as a streamed step's head does.

A tied embedding's copies on the first and the last stage are summed after the passes (stage_tied.py); a block's
expert unit (experts over ep) is read by each visit of its block; a frozen base (LoRA) streams read-only, its
embedding takes no backward visit, and the adapters' sync (`others`) reduces them at finish.

Evaluation runs the pipeline's forward-only flow, each stage streaming its units once per batch.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, cast

import torch
from torch import nn

from behemoth.comm import CommMeter
from behemoth.errors import BehemothError
from behemoth.models.causal_lm import counted_targets
from behemoth.offload.executor import BoundaryPass, Streamer
from behemoth.offload.order import Action as Visit
from behemoth.offload.runtime import OffloadSync
from behemoth.offload.stage_order import stage_passes, stage_units
from behemoth.offload.stage_tied import TiedSteps
from behemoth.offload.store import UnitStore
from behemoth.parallel.context import ContextParallel
from behemoth.parallel.pipeline.apply import PipelineParallel, tied_peer
from behemoth.parallel.pipeline.executor import ACT, GRAD, ActionTime, Activations, PipeComm, PipelineExecutor, StepTrace
from behemoth.parallel.pipeline.executor import _Step as PipelineStep  # the mailbox, p2p groups and checks of one step
from behemoth.parallel.pipeline.partition import PipelineStage, full_sequence_like
from behemoth.parallel.pipeline.schedules import COMPUTE
from behemoth.parallel.sync import GradSync
from behemoth.parallel.zero.runtime import DTYPES

Batch = list[tuple[torch.Tensor, torch.Tensor]]
PASS_KIND = {"F": "F", "FB": "F", "B": "B", "BI": "BI", "W": "W"}  # a pass by its first visit (a last stage's F ends in FB)


def global_units(sync: OffloadSync, blocks: nn.Module, n_layer: int) -> list[int]:
    """The order.py number of each of this rank's units (its stages' embedding, blocks and head); a block's expert unit
    (experts over ep) is n_layer + 2 + the block's number: no visit names it, its block's visits read it."""
    index = {id(m): int(k) for k, m in blocks._modules.items()}
    out = []
    for spec in sync.specs:
        if spec.role == "block" and spec.group is None:
            out.append(index[id(spec.module)] + 1)
        elif spec.role in ("embedding", "head"):
            out.append(0 if spec.role == "embedding" else n_layer + 1)
        elif spec.role == "block":
            out.append(-1)  # an expert unit: numbered from the block that reads it, below
        else:
            why = f"offload under a pipeline streams embeddings, blocks and heads; {spec.names[0]} is none of them"
            raise BehemothError(why, "use parallel.pp=1")
    for unit, read in sync.streamer.reads.items():
        for j in read:
            if out[j] == -1:
                out[j] = n_layer + 1 + out[unit]
    return out


def tied_steps(sync: OffloadSync, pipeline: PipelineParallel, embedding: UnitStore | None, meter: CommMeter | None) -> TiedSteps | None:
    """The step hooks that sum a tied embedding's two copies, on the first and the last stage's ranks when they differ."""
    peer = tied_peer(pipeline.schedule, pipeline.rank, pipeline.tied)
    if peer is None or embedding is None:
        return None
    counted = pipeline.schedule.stage_ranks[0][0] == pipeline.rank  # the first stage counts it in the norm, as in memory
    return TiedSteps(sync.steps, embedding, peer=peer, group=pipeline.group, counted=counted, timeout_s=pipeline.policy.timeout_s, meter=meter)


class _Cursor:
    """Where the schedule's non-compute actions stand: p2p groups issued up to `issued`, actions run up to `ran`."""

    def __init__(self, ex: PipelineExecutor, step: PipelineStep) -> None:
        self.ex, self.step, self.issued, self.ran = ex, step, 0, 0

    def issue_through(self, index: int) -> None:
        """Issue every p2p group due at or before action `index` (a send's goes out right after its pass)."""
        while self.issued <= min(index, len(self.ex.actions) - 1):
            for group in self.ex.groups.get(self.issued, ()):
                self.step.issue(group)
            self.issued += 1

    def run_until(self, index: int) -> None:
        """Run the transfers (receives, sends, the optimizer step's end) before action `index`; compute passes are the
        streamer's."""
        while self.ran < index:
            self.issue_through(self.ran)
            a = self.ex.actions[self.ran]
            if a.kind not in COMPUTE:
                self.step.run(self.ran, a)
            self.ran += 1


class StageStreams:
    """A pipeline rank's executor when its stages' units live on offload's tiers (parallel/executor.py's protocol)."""

    def __init__(
        self,
        sync: OffloadSync,
        pipeline: PipelineParallel,
        *,
        hidden_size: int,
        meter: CommMeter | None = None,
        context: ContextParallel | None = None,
        others: list[GradSync] | None = None,
    ) -> None:
        self.sync, self.pipeline, self.context = sync, pipeline, context  # context: cp > 1, each rank streams its shard of the tokens
        self.others = others or []  # resident parameters' syncs (a frozen base's adapters), reduced at finish
        self.schedule, self.rank, self.device = pipeline.schedule, pipeline.rank, sync.rt.device
        model, view = sync.model, sync.lm.layers
        self.blocks = model.get_submodule(view.blocks)
        self.units = stage_units(pipeline.bounds)
        numbers = global_units(sync, self.blocks, pipeline.bounds[-1])
        local = {g: i for i, g in enumerate(numbers)}
        reads = {numbers[i]: tuple(numbers[j] for j in r) for i, r in sync.streamer.reads.items() if r}
        stores = self.stores = {g: sync.stores[local[g]] for g in numbers}  # by order.py's unit number
        self.tied = tied_steps(sync, pipeline, stores.get(0), meter)
        hooks = sync.steps if self.tied is None else self.tied
        self.streamer = Streamer(model, view, cast(Any, stores), reads, io=sync.io, prefetch=sync.prefetch, device=self.device, hooks=hooks)
        self.executor = PipelineExecutor(
            self.schedule,
            self.rank,
            pipeline.stages,
            PipeComm(pipeline.group, pipeline.policy.timeout_s, meter),
            Activations(hidden_size, DTYPES[sync.policy.param_dtype], self.device, pipeline.policy.seq_split),
        )

    def boundary(self, batches: Batch | None = None) -> BoundaryPass:
        """A pass's kept state; under cp each micro-batch's global positions (from its token shard), which every stage's
        embedding, context and recomputation use."""
        positions = None if self.context is None or batches is None else {i: self.context.positions_of_shard(x) for i, (x, _) in enumerate(batches)}
        state = BoundaryPass(self.sync.model, self.sync.lm.layers, cast(list, self.blocks), self.device, positions)
        state.embedding_ends_ctx = False  # a later stage's W may still need it (V-shaped schedules): `end_pass` drops it
        return state

    def shard(self, batches: Batch) -> Batch:
        """Each micro-batch's tokens and targets cut to this rank's cp shard (as they are without cp)."""
        if self.context is None:
            return [(x.to(self.device), y.to(self.device)) for x, y in batches]
        layout = self.context.layout
        return [(layout.shard(x.to(self.device)), layout.shard(y.to(self.device))) for x, y in batches]

    def enter(self, state: BoundaryPass, stage: int, mb: int, h: torch.Tensor) -> None:
        """A later stage's received activation as its first block's kept input (and the blocks' context, once per mb)."""
        state.hidden[(self.units[stage][0] - 1, mb)] = h
        if mb not in state.ctx:
            with torch.no_grad():
                whole = full_sequence_like(h, self.pipeline.policy.seq_split)
                state.ctx[mb] = state.view.context(state.model, whole, state.positions.get(mb))

    def run(self, micro_batches: Batch, loss_fn: Any, autocast: Any) -> torch.Tensor:
        """Forward and backward of every micro-batch in the schedule's order; this rank's share of the (scaled) loss."""
        sync, ex = self.sync, self.executor
        if sync.optimizer is None:
            raise RuntimeError("build the optimizer before training: the offload runtime steps units during the step")
        if len(micro_batches) != self.schedule.microbatches:
            raise BehemothError(
                f"{len(micro_batches)} micro-batches for a {self.schedule.name} schedule built for {self.schedule.microbatches}",
                "build the pipeline for the step's micro-batch count",
            )
        for other in self.others:  # passes interleave micro-batches: resident gradients are reduced at finish
            other.begin_micro_batch(False)
        batches = self.shard(micro_batches)
        step, state = PipelineStep(ex, batches, loss_fn, autocast), self.boundary(batches)
        cursor = _Cursor(ex, step)
        passes = stage_passes(self.schedule, self.rank, self.units, embedding_backward=not self.frozen_embedding())
        where = {v: (i, j == 0, j == len(visits) - 1) for i, visits in passes for j, v in enumerate(visits)}
        kinds = {i: PASS_KIND[visits[0].kind] for i, visits in passes}  # F, B, BI or W (a first stage's W is a full B)
        self.ends_ctx = {visits[0].mb: i for i, visits in passes if kinds[i] != "F"}  # mb -> its last backward pass here
        total, times, started = torch.zeros((), device=self.device), [], [0.0]

        def compute(v: Visit) -> None:
            nonlocal total
            index, first, last = where[v]
            a = ex.actions[index]
            if first:
                started[0] = time.perf_counter()
                cursor.run_until(index)
                cursor.issue_through(index)
                self.begin_pass(kinds[index], a.stage, v.mb, step, state)
            loss = state.train(v, batches[v.mb], loss_fn, autocast)
            total = total if loss is None else total + loss
            self.streamer.peak_activation_bytes = max(self.streamer.peak_activation_bytes, state.held_bytes())
            if last:
                self.end_pass(kinds[index], a.stage, v.mb, step, state)
                if self.ends_ctx.get(v.mb) == index:  # no pass of this rank uses the micro-batch's blocks' context again
                    state.ctx.pop(v.mb, None)
                cursor.ran = index + 1
                cursor.issue_through(index + 1)
                step.reap_sends()
                times.append(ActionTime(a, started[0], time.perf_counter()))

        self.streamer.run([v for _, visits in passes for v in visits], compute)
        cursor.run_until(len(ex.actions))
        step.finish()
        if self.tied is not None:  # both copies' gradients complete now: summed, then stepped alike
            self.tied.sum_copies()
        self.pipeline.last_trace = StepTrace(self.rank, times, total, self.streamer.peak_activation_bytes)
        sync.streamer.peak_activation_bytes = self.streamer.peak_activation_bytes  # what the sync's metrics report
        return total

    def frozen_embedding(self) -> bool:
        """Whether this rank's first stage holds a frozen embedding (a LoRA base): its lookup has no gradient to give."""
        embedding = self.stores.get(0)
        return embedding is not None and embedding.frozen

    def begin_pass(self, kind: str, stage: int, mb: int, step: PipelineStep, state: BoundaryPass) -> None:
        """A pass's input from the mailbox: a later stage's activation, an earlier stage's output gradient (`kind`: the
        pass's visits, F, B, BI or W)."""
        if kind == "F" and stage > 0:
            self.enter(state, stage, mb, step.mailbox.pop((ACT, stage - 1, mb)))
        elif kind in ("B", "BI") and stage < self.schedule.num_stages - 1:
            state.grads[(self.units[stage][-1], mb)] = step.mailbox.pop((GRAD, stage + 1, mb)).to(self.executor.activations.dtype)

    def end_pass(self, kind: str, stage: int, mb: int, step: PipelineStep, state: BoundaryPass) -> None:
        """A pass's output into the mailbox: a stage's output for the next, the gradient of its input for the previous."""
        if kind == "F" and stage < self.schedule.num_stages - 1:
            step.mailbox[(ACT, stage, mb)] = state.hidden.pop((self.units[stage][-1], mb)).to(self.executor.activations.dtype).contiguous()
        elif kind in ("B", "BI") and stage > 0:
            step.mailbox[(GRAD, stage, mb)] = state.grads.pop((self.units[stage][0] - 1, mb)).contiguous()

    @torch.no_grad()
    def forward_only(self, batches: Batch, loss_sum: Any, autocast: Any) -> torch.Tensor:
        """[summed token loss, token count] of the batches whose last stage runs here, each stage streamed per batch."""

        batches = self.shard(batches)

        def stage_forward(part: PipelineStage, b: int, x: torch.Tensor) -> torch.Tensor:
            state, units = self.boundary(batches), self.units[part.stage]
            if not part.is_first:
                self.enter(state, part.stage, b, x)
            visits = [Visit("E" if part.is_last and u == units[-1] else "F", u, b) for u in units]
            out: list[torch.Tensor] = []

            def compute(v: Visit) -> None:
                if v.kind == "F":
                    state.forward(v, x, autocast, keep_rng=False)
                else:
                    out.append(state.head_logits(v, autocast))

            self.streamer.run(visits, compute)
            if not part.is_last:
                return state.hidden[(units[-1], b)]
            targets = batches[b][1].to(self.device)
            return torch.stack([loss_sum(out[0], targets).double(), counted_targets(targets).double()])

        stats = torch.zeros(2, dtype=torch.float64, device=self.device)
        for out in self.executor.flow([inputs for inputs, _ in batches], stage_forward).values():
            stats += out
        self.sync.io.drain()
        return stats

    def logits(self, inputs: list[torch.Tensor], autocast: Any = contextlib.nullcontext) -> list[torch.Tensor]:
        raise RuntimeError("a pipelined model has no whole forward on one rank; run its stages through the pipeline")
