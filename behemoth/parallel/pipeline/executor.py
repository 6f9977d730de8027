"""Runs one pipeline rank's action list for a training step, with asynchronous point-to-point transfers.

Communication is issued in groups, each one `dist.batch_isend_irecv` (`comm.batch_p2p`), as
`p2p_groups` lays them out: a send goes out in the group right after the pass that produces it; a
receive is posted in the group of the slot where its message exists in the schedule's reference
timeline, or up to `lookahead` passes earlier where that keeps the rank's transfers in message
order, so it travels while this rank computes (message-driven, as in AxoNN). A receive is waited
for only when its RECV action (right before the consumer) runs; sends never block the host, are
reaped as they complete and waited for at the end of the step. Why groups: on NCCL, a rank's
batched transfers run in issue order on one stream and a send completes only when its receive is
posted, so receives posted one at a time ahead of sends deadlock (1F1B's steady state does);
`validate` proves every schedule's groups deadlock-free and matched in order under those rules
(`rendezvous.py`). Tested on gloo (which runs a group's ops one by one, matched by tag) and by that
model, not on GPUs. Chimera's gradient sync exchanges in one group too (`pair_all_reduce`), and
the forward-only pass (`flow`: evaluation and generation) issues each transfer as a group of one,
in (batch, stage) order on every rank. Every wait is bounded by `timeout_s` and fails with an error naming this rank, the action and the peer.

The executor runs passes and transfers and stops at OPT_STEP: finishing the gradients, clipping,
the optimizer step and the loss reduction are the engine's, for every layout.

Tensors move through a mailbox keyed by (payload, stage, micro-batch): a forward deposits its
output, a backward the gradient of its input; a send's group takes the tensor out, a RECV puts one
in, and when producer and consumer share a rank the consumer takes it straight from the mailbox.

The last stage turns its output into the loss with the function the engine hands to `run` (the
engine's one scaling of the loss), so the summed gradients are those of the single-process run.
Each action's start and end (time.perf_counter, one clock for all processes of a machine) are
recorded, so the bubble fraction can be measured and compared with `simulate`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from behemoth.comm import P2P, CommMeter, Pending, batch_p2p, pair_all_reduce, reduce_flat
from behemoth.errors import BehemothError
from behemoth.flight import HangError
from behemoth.models.causal_lm import counted_targets
from behemoth.parallel.deferred import DeferralSlot
from behemoth.parallel.pipeline.analysis.rendezvous import check_rendezvous
from behemoth.parallel.pipeline.buffers import RecvBuffers
from behemoth.parallel.pipeline.p2p_groups import RECV_LOOKAHEAD, P2PGroup, message_key, p2p_groups, reference_timeline
from behemoth.parallel.pipeline.partition import PipelineStage
from behemoth.parallel.pipeline.schedules import COMPUTE, RECVS, Action, Kind, Schedule
from behemoth.parallel.pipeline.stage import Stashed, StashMeter, backward_full, backward_input, backward_weight
from behemoth.parallel.recompute import RngState, replayed_rng, save_rng

ACT, GRAD = "act", "grad"
PAYLOAD = {Kind.SEND_ACT: ACT, Kind.RECV_ACT: ACT, Kind.SEND_GRAD: GRAD, Kind.RECV_GRAD: GRAD}
SYNC_TAG = 1 << 22  # tags of gradient syncs between replicas; activations and gradients use 1 .. SYNC_TAG-1
EVAL_TAG = 1 << 23  # tags of the forward-only pass (evaluation, generation)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Batch = list[tuple[torch.Tensor, torch.Tensor]]
Autocast = Callable[[], contextlib.AbstractContextManager]
StageForward = Callable[[PipelineStage, int, torch.Tensor], torch.Tensor]  # (stage, batch index, its input) -> its output


@dataclass(frozen=True)
class PipeComm:
    """How a pipeline rank reaches the others: the pp group, the longest wait, the traffic meter, how early receives go out."""

    group: dist.ProcessGroup
    timeout_s: float
    meter: CommMeter | None = None
    lookahead: int = RECV_LOOKAHEAD


@dataclass(frozen=True)
class Activations:
    """What stages exchange: [batch / batch_split, sequence / seq_split, hidden] tensors of `dtype` on `device`
    (seq_split: SP's tp; batch_split and a per-rank hidden: a 2-D/3-D tensor-parallel rank's block of the sequences)."""

    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    seq_split: int = 1
    batch_split: int = 1

    def shape(self, inputs: torch.Tensor) -> tuple[int, ...]:
        """The shape of an activation (or its gradient) between stages for a micro-batch of token ids [B, T]."""
        return (inputs.shape[0] // self.batch_split, inputs.shape[1] // self.seq_split, self.hidden_size)


class PipelineWaitError(BehemothError):
    """A message or gradient sync that did not complete within run.timeout_s."""


@dataclass(frozen=True)
class Transfer:
    """One SEND/RECV of a p2p group, resolved once per executor: its action index, direction, peer, tag, mailbox key."""

    index: int
    send: bool
    peer: int
    tag: int
    key: tuple[str, int, int]  # (payload, stage, micro-batch)


@dataclass(frozen=True)
class ActionTime:
    """When one action ran on this rank (seconds on the machine's monotonic clock)."""

    action: Action
    start: float
    end: float


@dataclass
class StepTrace:
    """What one rank's step did: per-action times, its share of the loss, its peak stashed activations."""

    rank: int
    times: list[ActionTime]
    loss: torch.Tensor
    peak_stash_bytes: int

    def busy(self) -> float:
        """Seconds spent in compute passes (F, B, BI, W)."""
        return sum(t.end - t.start for t in self.times if t.action.kind in COMPUTE)


class PipelineExecutor:
    """One rank's executor: its schedule, its pipeline stages, and how to reach the other ranks.

    `replica_params`: per stage, the parameters Chimera's GRAD_SYNC sums with the stage's other replica;
    `on_grads(stage)`: called once a pass has written a stage's weight gradients (ZeRO-2 reduces them);
    `deferral`: the slot the model's deferrable linear layers read (zero-bubble schedules' split backward);
    `static_stash`: what a stage's forward saves depends only on its input's shape (not on routing, as a mixture of experts'
    does), so its bytes are counted by the first such pass and reused: the counting hook runs on every saved tensor."""

    def __init__(
        self,
        schedule: Schedule,
        rank: int,
        stages: dict[int, PipelineStage],
        comm: PipeComm,
        activations: Activations,
        *,
        replica_params: dict[int, list[nn.Parameter]] | None = None,
        on_grads: Callable[[int], None] | None = None,
        deferral: DeferralSlot | None = None,
        static_stash: bool = False,
    ) -> None:
        self.schedule, self.rank, self.stages, self.comm, self.activations = schedule, rank, stages, comm, activations
        self.replica_params, self.on_grads = replica_params or {}, on_grads
        self.deferral = deferral or DeferralSlot()  # where a split backward's input pass queues weight gradients
        self.device = activations.device
        self.actions = schedule.per_rank[rank]
        self.recomputed = {(a.stage, a.microbatch) for a in self.actions if a.kind is Kind.RECOMPUTE}  # 1f1b-scp
        timeline = reference_timeline(schedule)
        plan = lambda s, r: p2p_groups(s, r, comm.lookahead, timeline)  # noqa: E731
        check_rendezvous(schedule, plan)  # milliseconds; refuses groups NCCL could hang on
        self.groups: dict[int, list[P2PGroup]] = {}  # action index -> the p2p groups issued just before it
        for g in plan(schedule, rank):
            self.groups.setdefault(g.at, []).append(g)
        self.resolved: dict[P2PGroup, tuple[Transfer, ...]] = {}  # each group's transfers, worked out at its first issue
        self.stash_meter = StashMeter()
        self.stash_sizes: dict[tuple, int] | None = {} if static_stash else None  # (stage, shape, dtype, modes) -> bytes
        self.buffers = RecvBuffers(self.device)  # receive buffers kept across steps (buffers.py)

    def transfers(self, group: P2PGroup) -> tuple[Transfer, ...]:
        """The group's transfers (the same every step: worked out once)."""
        got = self.resolved.get(group)
        if got is None:
            got = self.resolved[group] = tuple(
                Transfer(j, a.kind not in RECVS, a.peer, self.tag(a), (PAYLOAD[a.kind], a.stage, a.microbatch))
                for j, a in ((j, self.actions[j]) for j in group.ops)
            )
        return got

    def tag(self, a: Action) -> int:
        """A message's tag, unique within a step: (payload, producing stage, micro-batch)."""
        payload, stage, microbatch = message_key(a)
        return 1 + (payload * self.schedule.num_stages + stage) * self.schedule.microbatches + microbatch

    def run(self, micro_batches: Batch, loss: LossFn, autocast: Autocast = contextlib.nullcontext) -> StepTrace:
        """Run this rank's actions for one step: passes, transfers and replica syncs, up to the optimizer step.
        `loss(output, targets)` is a last stage's loss of one micro-batch, as the engine scales it."""
        if len(micro_batches) != self.schedule.microbatches:
            raise BehemothError(
                f"{len(micro_batches)} micro-batches for a {self.schedule.name} schedule built for {self.schedule.microbatches}",
                "build the pipeline for the step's micro-batch count",
            )
        step = _Step(self, micro_batches, loss, autocast)
        times = []
        for i, a in enumerate(self.actions):
            for g in self.groups.get(i, ()):
                step.issue(g)
            t0 = time.perf_counter()
            step.run(i, a)
            times.append(ActionTime(a, t0, time.perf_counter()))
        step.finish()
        self.buffers.end_step()
        return StepTrace(self.rank, times, step.loss, step.peak_stash)

    def wait(self, pending: Pending, index: int, a: Action, what: str) -> None:
        """Wait at most timeout_s; otherwise fail naming this rank, the action and the peer."""
        try:
            pending.wait(self.comm.timeout_s)
        except (RuntimeError, HangError) as err:
            raise self.wait_error(err, index, a, what) from None

    def wait_error(self, err: RuntimeError | HangError, index: int, a: Action, what: str) -> PipelineWaitError:
        """One line naming this rank, the action (index -1: the forward-only pass), the peer and why (the flight
        recorder's diagnosis: which ranks never arrived; or c10d's reason)."""
        if isinstance(err, HangError):
            detail = err.diagnosis
        else:
            detail = str(err).strip().splitlines()[0][-160:] if str(err).strip() else type(err).__name__
        me, peer = dist.get_rank(), dist.get_global_rank(self.comm.group, a.peer)
        where = f"action {index} {a}" if index >= 0 else f"{a} of the forward-only pass"
        return PipelineWaitError(
            f"pipeline rank {self.rank} (global rank {me}) waited {what} at {where} "
            f"with pipeline rank {a.peer} (global rank {peer}) and gave up after run.timeout_s={self.comm.timeout_s:g} s ({detail})",
            f"see rank {peer}'s log: it failed, hangs, or runs a different schedule; raise run.timeout_s if it is only slow",
        )

    def send_recv(self, op: P2P) -> Pending:
        """One transfer as a batched group of its own."""
        return batch_p2p([op], self.comm.group, self.comm.meter)[0]

    @torch.no_grad()
    def forward_only(self, batches: Batch, loss_sum: LossFn, autocast: Autocast = contextlib.nullcontext) -> torch.Tensor:
        """[summed token loss, token count] of the batches whose last stage runs here (first replica of every stage)."""

        def stage_forward(part: PipelineStage, b: int, x: torch.Tensor) -> torch.Tensor:
            with autocast():
                out = part.forward(x)
            if not part.is_last:
                return out
            targets = batches[b][1].to(self.device)
            return torch.stack([loss_sum(out, targets).double(), counted_targets(targets).double()])

        stats = torch.zeros(2, dtype=torch.float64, device=self.device)
        for out in self.flow([inputs for inputs, _ in batches], stage_forward).values():
            stats += out
        return stats

    @torch.no_grad()
    def flow(self, inputs: Sequence[torch.Tensor], stage_forward: StageForward) -> dict[int, torch.Tensor]:
        """Batches forward through the stages, no backward (evaluation, generation): each stage runs on its first replica,
        `stage_forward(stage, batch index, input)` on token ids (first stage) or the previous stage's output; returns the
        last stage's outputs of the batches whose last stage runs here. Each transfer is a group of one, in (batch, stage)
        order on every rank, so stage s runs batch b while stage s+1 runs batch b-1."""
        owner = [ranks[0] for ranks in self.schedule.stage_ranks]
        sends: list[tuple[Pending, Action, torch.Tensor]] = []
        local: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        for b, ids in enumerate(inputs):
            for stage in (s for s in range(len(owner)) if owner[s] == self.rank):
                part, tag = self.stages[stage], EVAL_TAG + b * len(owner) + stage
                if part.is_first:
                    x = ids.to(self.device)
                elif owner[stage - 1] == self.rank:
                    x = local.pop(stage - 1)
                else:
                    x = self.buffers.take(self.activations.shape(ids), self.activations.dtype)
                    a = Action(Kind.RECV_ACT, stage - 1, b, peer=owner[stage - 1])
                    self.wait(self.send_recv(P2P(False, x, a.peer, tag - 1)), -1, a, "for a forward-only activation")
                out = stage_forward(part, b, x)
                if part.is_last:
                    outputs[b] = out
                elif owner[stage + 1] == self.rank:
                    local[stage] = out
                else:
                    a, out = Action(Kind.SEND_ACT, stage, b, peer=owner[stage + 1]), out.to(self.activations.dtype).contiguous()
                    sends.append((self.send_recv(P2P(True, out, a.peer, tag)), a, out))  # keep `out` alive until sent
        for pending, a, _ in sends:
            self.wait(pending, -1, a, "for a forward-only send")
        self.buffers.end_step()
        return outputs


class _Step:
    """The state of one step on one rank: mailbox, posted receives, in-flight sends, stashed activations."""

    def __init__(self, ex: PipelineExecutor, micro_batches: Batch, loss: LossFn, autocast: Autocast) -> None:
        self.ex, self.batches, self.loss_of, self.autocast = ex, micro_batches, loss, autocast
        self.mailbox: dict[tuple[str, int, int], torch.Tensor] = {}
        self.posted: dict[int, tuple[Pending, torch.Tensor]] = {}
        self.sends: list[tuple[Pending, int, Action, torch.Tensor]] = []
        self.stash: dict[tuple[int, int], Stashed] = {}
        self.kept: dict[tuple[int, int], tuple[torch.Tensor, RngState]] = {}  # inputs of forwards to recompute
        self.loss = torch.zeros((), device=ex.device)
        self.stash_bytes = self.peak_stash = 0
        self.handlers = {
            Kind.FORWARD: self.forward,
            Kind.RECOMPUTE: self.recompute,
            Kind.BACKWARD: self.backward,
            Kind.BACKWARD_INPUT: self.backward_input,
            Kind.BACKWARD_WEIGHT: self.backward_weight,
            Kind.SEND_ACT: self.send,
            Kind.SEND_GRAD: self.send,
            Kind.RECV_ACT: self.recv,
            Kind.RECV_GRAD: self.recv,
            Kind.GRAD_SYNC: self.grad_sync,
            Kind.OPT_STEP: self.opt_step,
        }

    def run(self, index: int, a: Action) -> None:
        self.handlers[a.kind](index, a)

    def issue(self, group: P2PGroup) -> None:
        """Issue one p2p group: its sends take their tensors from the mailbox, its receives a buffer nothing else holds."""
        ex, ops, transfers = self.ex, [], self.ex.transfers(group)
        for t in transfers:
            if t.send:
                tensor = self.mailbox.pop(t.key)
            else:
                tensor = ex.buffers.take(ex.activations.shape(self.batches[t.key[2]][0]), ex.activations.dtype)
            ops.append(P2P(t.send, tensor, t.peer, t.tag))
        for t, op, pending in zip(transfers, ops, batch_p2p(ops, ex.comm.group, ex.comm.meter)):
            if t.send:
                self.sends.append((pending, t.index, ex.actions[t.index], op.tensor))
            else:
                self.posted[t.index] = (pending, op.tensor)

    def recv(self, index: int, a: Action) -> None:
        pending, buffer = self.posted.pop(index)  # issued with its group, at or before this action
        self.ex.wait(pending, index, a, "for its message")
        self.mailbox[(PAYLOAD[a.kind], a.stage, a.microbatch)] = buffer

    def send(self, index: int, a: Action) -> None:
        """Nothing left to do: the send went out with its group, right after the pass that produced it."""

    def forward(self, index: int, a: Action) -> None:
        ex, part = self.ex, self.ex.stages[a.stage]
        inputs = self.batches[a.microbatch][0]
        x = inputs.to(ex.device) if part.is_first else self.mailbox.pop((ACT, a.stage - 1, a.microbatch))
        if (a.stage, a.microbatch) in ex.recomputed:  # keep the input only (counted as stashed); RECOMPUTE reruns it
            self.kept[(a.stage, a.microbatch)] = (x, save_rng(ex.device))
            self.stash_bytes += 0 if part.is_first else x.nbytes
            self.peak_stash = max(self.peak_stash, self.stash_bytes)
            with torch.no_grad():
                self.stage_pass(a, x)
            self.reap_sends()
            return
        self.stash_pass(a, x if part.is_first else x.requires_grad_())

    def recompute(self, index: int, a: Action) -> None:
        """The forward again, from its kept input with the random state it had, this time keeping what backward needs."""
        x, rng = self.kept.pop((a.stage, a.microbatch))
        self.stash_bytes -= 0 if self.ex.stages[a.stage].is_first else x.nbytes
        with replayed_rng(rng, self.ex.device):
            self.stash_pass(a, x if self.ex.stages[a.stage].is_first else x.detach().requires_grad_(), recomputed=True)

    def stash_pass(self, a: Action, x: torch.Tensor, recomputed: bool = False) -> None:
        """A forward under autograd whose graph is stashed for the backward; its saved bytes are counted."""
        ex, part = self.ex, self.ex.stages[a.stage]
        key = (a.stage, tuple(x.shape), x.dtype, recomputed, part.model.training, torch.is_autocast_enabled(x.device.type))
        nbytes = None if ex.stash_sizes is None else ex.stash_sizes.get(key)
        if nbytes is None:
            with ex.stash_meter.measure() as meter:
                out = self.stage_pass(a, x, deposit=not recomputed)
            nbytes = meter.bytes
            if ex.stash_sizes is not None:
                ex.stash_sizes[key] = nbytes
        else:
            out = self.stage_pass(a, x, deposit=not recomputed)
        self.stash[(a.stage, a.microbatch)] = Stashed(None if part.is_first else x, out, nbytes)
        self.stash_bytes += nbytes
        self.peak_stash = max(self.peak_stash, self.stash_bytes)
        self.reap_sends()

    def stage_pass(self, a: Action, x: torch.Tensor, deposit: bool = True) -> torch.Tensor:
        """The stage's forward (and the loss on the last stage); `deposit`: hand its output or loss on (not when recomputed)."""
        part = self.ex.stages[a.stage]
        with self.autocast():
            out = part.forward(x)
        if part.is_last:
            out = self.loss_of(out, self.batches[a.microbatch][1].to(self.ex.device))
        if deposit and part.is_last:
            self.loss += out.detach()
        elif deposit:
            self.mailbox[(ACT, a.stage, a.microbatch)] = out.detach().to(self.ex.activations.dtype)
        return out

    def output_grad(self, a: Action, s: Stashed) -> torch.Tensor | None:
        """The gradient of this stage's output (None on the last stage, whose output is the loss), in its dtype."""
        if self.ex.stages[a.stage].is_last:
            return None
        return self.mailbox.pop((GRAD, a.stage + 1, a.microbatch)).to(s.output.dtype)

    def deposit_input_grad(self, a: Action, grad: torch.Tensor | None) -> None:
        if not self.ex.stages[a.stage].is_first:
            self.mailbox[(GRAD, a.stage, a.microbatch)] = grad

    def release(self, s: Stashed) -> None:
        self.stash_bytes -= s.nbytes
        self.reap_sends()

    def backward(self, index: int, a: Action) -> None:
        s = self.stash.pop((a.stage, a.microbatch))
        self.deposit_input_grad(a, backward_full(s, self.output_grad(a, s)))
        self.release(s)
        self.grads_done(a)

    def backward_input(self, index: int, a: Action) -> None:
        s = self.stash[(a.stage, a.microbatch)]
        self.deposit_input_grad(a, backward_input(s, self.output_grad(a, s), self.ex.deferral))
        if s.input is not None:  # the input pass freed the graph (the weight pass keeps only its deferred products)
            self.release(s)
            s.nbytes = 0

    def backward_weight(self, index: int, a: Action) -> None:
        s = self.stash.pop((a.stage, a.microbatch))
        backward_weight(s)
        self.release(s)
        self.grads_done(a)

    def grads_done(self, a: Action) -> None:
        if self.ex.on_grads is not None:
            self.ex.on_grads(a.stage)

    def grad_sync(self, index: int, a: Action) -> None:
        """Sum this stage's gradients with its other replica's (Chimera), one exchange of a flat buffer."""
        ex, comm = self.ex, self.ex.comm
        try:
            reduce_flat(
                [p.grad for p in ex.replica_params.get(a.stage, [])],
                lambda flat: pair_all_reduce(flat, a.peer, comm.group, comm.meter, tag=SYNC_TAG + a.stage, timeout_s=comm.timeout_s),
            )
        except (RuntimeError, HangError) as err:
            raise ex.wait_error(err, index, a, "for the gradient sync") from None

    def opt_step(self, index: int, a: Action) -> None:
        """The end of the passes: every send completes; the engine takes over for the optimizer step."""
        self.finish()

    def reap_sends(self) -> None:
        """Drop completed sends so their tensors can be freed."""
        self.sends = [s for s in self.sends if not s[0].done()]

    def finish(self) -> None:
        """Wait for every send of the step (bounded)."""
        for pending, index, a, _ in self.sends:
            self.ex.wait(pending, index, a, "for its send to complete")
        self.sends = []
        if self.posted or self.stash or self.kept:
            raise BehemothError(
                f"pipeline rank {self.ex.rank}: the step ended with {len(self.posted)} unconsumed receives, "
                f"{len(self.stash)} stashed micro-batches and {len(self.kept)} never recomputed",
                "the schedule is incomplete; validate it",
            )
