"""The offload runtime: ZeRO-3's units with their shards on host or disk tiers, streamed unit by unit, stepped where they live.

    units = shard_parameters(model, dp_group, layers=lm.layers)          # ZeRO-3's units, on meta
    sync = apply_offload(lm, units, rt, policy, seed=seed)                # a GradSync (parallel/sync.py)
    optimizer = sync.build_optimizer(settings)                            # the engine's, as for any sync
    loss = StreamedSteps(sync).run(micro_batches, loss_fn, autocast)      # the model's executor (parallel/executor.py)
    sync.clip_held_grads(coef, max_norm)                                  # after parallel/clip.py's global norm

Each rank keeps its 1/dp shard of every unit (the ZeRO-3 partition) on the tiers the policy names and
streams only that shard; the model is all-gathered unit by unit for compute by the unit runtime in-memory
ZeRO-3 runs (parallel/zero/units.py `UnitRuntime`). The optimizer step happens where the state lives, unit
by unit, during backward (fused) or at the unit's next fetch (deferred): stepper.py.

With parallel.param_dtype=bf16 the precision is ZeRO-3's: float32 master shards and moments stay on their tiers; a
fetched shard is cast to bf16 and the unit all-gathered and computed with in bf16; its gradient is reduce-scattered,
accumulated (and, partial or deferred, kept on the gradient tier) in bf16, clipped in bf16 and stepped in float32.
Checkpoints hold the float32 masters, so they load into any layout and either dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from behemoth.comm import CommMeter, barrier
from behemoth.errors import BehemothError
from behemoth.models.causal_lm import CausalLM, counted_targets, tied_names
from behemoth.models.init import draw_full
from behemoth.offload import journal, scratch
from behemoth.offload.budget import ActivationShape, fit_budget, return_freed_memory
from behemoth.offload.executor import Batch, Positions, Streamer
from behemoth.offload.frozen import FolderShards, FolderWeights
from behemoth.offload.io import IOPool
from behemoth.offload.journal import StepRecord
from behemoth.offload.optimizer import OffloadOptimizer
from behemoth.offload.order import forward_order, make_order
from behemoth.offload.policy import OffloadPolicy
from behemoth.offload.stepper import UnitSteps
from behemoth.offload.store import PendingStep, TierMeter, Tiers, UnitStore, ValueSource, initial_shard
from behemoth.parallel.context import ContextParallel
from behemoth.parallel.sync import AdamWSettings, GradSync, with_tied_names
from behemoth.parallel.zero.adam import make_adam
from behemoth.parallel.zero.layout import FlatLayout
from behemoth.parallel.zero.runtime import DTYPES
from behemoth.parallel.zero.tiers import FileTier, make_tier
from behemoth.parallel.zero.units import UnitSpec
from behemoth.topology import Runtime

MiB = 2**20


class OffloadSync(GradSync):
    """The gradient sync of a streamed model: units on tiers, gathered for compute, stepped where their state lives."""

    sharded = True
    gathers_parameters = True

    @property
    def steps_in_backward(self) -> bool:  # type: ignore[override]
        return self.policy.fused

    def __init__(
        self,
        lm: CausalLM,
        units: list[UnitSpec],
        rt: Runtime,
        policy: OffloadPolicy,
        *,
        value: ValueSource,
        activation: ActivationShape,
        tp: Any = None,
        copies: Callable[[str], int] | None = None,
        meter: CommMeter | None = None,
    ) -> None:
        self.lm, self.model, self.rt, self.policy, self.tp, self.meter = lm, lm.module, rt, policy, tp, meter
        self.group = rt.data_group()  # dense units over dp x ep; an expert unit over its own group (dp)
        self.aliases = tied_names(self.model)
        refuse_root_units(units)
        units, reads = stream_order(units)
        self.n_blocks = sum(u.role == "block" and u.group is None for u in units)
        layouts = [FlatLayout(u.names, u.shapes, dist.get_world_size(u.group or self.group)) for u in units]
        self.prefetch, in_flight, self.peak = fit_budget(
            policy,
            layouts,
            dist.get_rank(self.group),
            activation,
            device_type=rt.device.type,
            tied=any(u.role == "head" and u.reads for u in units),  # a pipeline stage may hold no head
            frozen=[u.frozen for u in units],
        )
        if rt.device.type == "cpu":
            return_freed_memory()
        reopen = f"rank0/{journal.STATE}" if policy.journal and policy.resume else None  # a journaled scratch resumed
        self.root = scratch.claim_for_run(policy.root or Path("offload-scratch"), policy.run_dir, rt, uses_disk=policy.uses_disk, keep=reopen)
        kinds = ("params", "grads", "optimizer")
        self.tiers = Tiers(*(make_tier(policy.tiers[k], rt.device, root=self.root / f"rank{rt.rank}" / k) for k in kinds))
        self.journal = self._open_journal()
        self.keep_scratch = self.journal is not None  # a journaled scratch outlives the process, until the run's end
        self.io = IOPool(policy.io_threads, max_in_flight=in_flight)
        self.specs = units
        self.stores: list[UnitStore] = []
        self.optimizer: OffloadOptimizer | None = None
        self._materialize(value)
        self.steps = UnitSteps(self.stores, self.io, fused=policy.fused, device=rt.device, tp=tp, copies=copies)
        self.streamer = Streamer(self.model, lm.layers, self.stores, reads, io=self.io, prefetch=self.prefetch, device=rt.device, hooks=self.steps)
        self.meter_tiers = TierMeter(self.tiers)

    def _open_journal(self) -> journal.Journal | None:
        """offload.commit=journal: the redo log over this rank's disk tiers (reopening the files a resumed run left)."""
        if not self.policy.journal:
            return None
        tiers = [self.tiers.params, self.tiers.grads, self.tiers.optimizer]
        if not all(isinstance(t, FileTier) for t in tiers):
            raise BehemothError(
                "offload.commit=journal commits the step on the disk tier",
                "set offload.params=disk offload.optimizer=disk (gradients: offload.grads=auto or disk)",
            )
        log = journal.Journal(self.root / f"rank{self.rt.rank}", *tiers)  # type: ignore[arg-type]
        log.reopening = self.policy.resume and log.resumable
        return log

    def _materialize(self, value: ValueSource) -> None:
        """Each unit's shard drawn (or loaded) one unit at a time and put on its tier: the model is never whole in memory.
        A frozen unit on the disk tier whose values are a model folder's is not copied at all: it is read from the folder
        (under tp, this rank's part of each split parameter only)."""
        splits = self.tp.split_layouts if self.tp is not None else None  # under tp each rank reads its part alone
        from_folder = FolderShards(value, self.tiers.params, splits) if isinstance(value, FolderWeights) and self.policy.params == "disk" else None
        for i, spec in enumerate(self.specs):
            store = UnitStore(i, spec, spec.group or self.group, self.tiers, self.meter, compute_dtype=DTYPES[self.policy.param_dtype])
            store.journal = self.journal
            if self.journal is not None and self.journal.reopening:
                store.reopen_params()
            elif spec.frozen and from_folder is not None:
                store.source = from_folder.plan(spec, store.layout, store.rank)
            else:
                store.allocate_params(initial_shard(spec, store.layout, store.rank, value))
            for locations in spec.locations:
                for module, attr in locations:
                    delattr(module, attr)
            self.stores.append(store)
        move_buffers(self.model, self.rt.device)

    # --- the GradSync protocol ---

    def zero_grad(self) -> None:
        """A new step: no gradient norm yet; the counters start again."""
        self.steps.new_step()
        self.meter_tiers.start()

    def finish(self) -> None:
        """Every write-back and fused step of this step done."""
        self.io.drain()

    def grad_slices(self) -> list[tuple[str, torch.Tensor]]:
        return []  # gradients live on their tier: the norm comes from `held_grad_square`

    def build_optimizer(self, settings: AdamWSettings) -> OffloadOptimizer:
        """AdamW over the shards (its zero state allocated on the optimizer tier now)."""
        adam = make_adam(settings, self.policy.bits, self.rt.device)
        for store in self.stores:
            store.attach_optimizer(adam)
        optimizer = self.optimizer = OffloadOptimizer(self, settings)
        self.steps.lr = lambda: optimizer.lr
        return optimizer

    def model_state(self) -> dict[str, Any]:
        """Parameters by every single-process name, as chunks aliasing the stored shards (owed steps applied first)."""
        self.flush()
        out: dict[str, Any] = {}
        for store in self.stores:
            if not store.frozen:  # a frozen base is not checkpointed: a resumed run reads it from its folder again
                out.update(store.param_chunks())
        return with_tied_names(out, self.aliases)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model states this rank keeps in memory (what is on disk is in `tier_bytes`)."""
        return {"params": self.tiers.params.resident_bytes(), "grads": self.tiers.grads.resident_bytes()}

    def after_load(self, optimizer: Any) -> None:
        """A checkpoint was loaded into the stored shards: no step is owed; the optimizer's step count is the loaded one."""
        self.flush()
        self.steps.forget_owed()
        if self.optimizer is not None:
            self.optimizer.after_load()

    # --- clipping: the norm of gradients that live on their tier ---

    def held_grad_square(self) -> torch.Tensor:
        """The squared gradient norm summed as each unit's gradient completed (tensor-parallel copies weighted)."""
        return self.steps.norm_sq

    def clip_held_grads(self, coef: float, max_norm: float) -> None:
        """The clipping coefficient each unit's deferred step applies."""
        if self.policy.fused and max_norm > 0:
            raise BehemothError(
                f"train.grad_clip={max_norm} with a fused offload step: units stepped before the norm was known",
                "set offload.step=deferred (or auto), or train.grad_clip=0",
            )
        self.coef = coef if max_norm > 0 else 1.0

    @property
    def coef(self) -> float:
        """The clipping coefficient of the step being taken (the deferred steps owed carry it)."""
        return self.steps.coef

    @coef.setter
    def coef(self, value: float) -> None:
        self.steps.coef = value

    def flush(self) -> None:
        """Apply every owed step now (before a checkpoint reads the stored shards)."""
        self.steps.flush()

    # --- measurements ---

    def step_metrics(self) -> dict[str, float]:
        """Bytes read and written this step per kind of state and tier, and the time compute waited for I/O."""
        out = self.meter_tiers.metrics()
        out["offload_io_wait_s"] = self.io.wait_s
        out["offload_activations_mb"] = self.streamer.peak_activation_bytes / MiB
        self.io.wait_s = 0.0
        return out

    def step_bytes(self) -> dict[str, tuple[int, int]]:
        """(read, written) bytes per kind of state since the step began."""
        return self.meter_tiers.moved()

    # --- offload.commit=journal (offload/journal.py) ---

    def journal_start(self, step: int, rng: dict[str, Any]) -> None:
        """The scratch as it stands is step `step` (drawn, or loaded from a checkpoint), recorded with the RNG to resume with."""
        if self.journal is not None:
            self.journal.start(StepRecord(step, self.steps.step_count, rng=rng))

    def commit_step(self, step: int, rng: dict[str, Any], metrics: dict[str, Any]) -> None:
        """After the step's backward and its norm: the gradient log and the commit record made durable on every rank, then the
        apply pass (each unit written beside its files, recorded, renamed in), then the step is the scratch's."""
        log = self.journal
        assert log is not None
        self.io.drain()
        owed = [s for s in self.stores if s.pending is not None]
        first = owed[0].pending if owed else None
        lr, coef = (first.lr, first.coef) if first else (0.0, 1.0)
        record = StepRecord(step, self.steps.step_count, lr, coef, [s.index for s in owed], rng, metrics)
        log.commit(record, [s.g_key for s in owed])
        barrier(self.rt.world_group)  # no rank applies a step that another may not have committed
        self.flush()
        log.complete()
        self.steps.forget_owed()

    def resume_journal(self) -> StepRecord:
        """Recovery: the step every rank committed finished from the log (idempotent per unit); the scratch's step record."""
        log = self.journal
        assert log is not None and log.reopening
        record = log.pending(self.rt.world_group, self.rt.device)
        if record is not None:
            applied = log.applied()
            for i in record.units:
                store, keys = self.stores[i], list(self.stores[i].state_keys.values())
                if i in applied:
                    log.finish_applied(store.p_key, keys)
                    continue
                log.discard_staged(store.p_key, keys)
                self.tiers.grads.reopen(store.g_key, store.shard_size, store.compute_dtype)  # type: ignore[attr-defined]
                store.pending = PendingStep(record.lr, record.coef, record.count)
            self.flush()
            log.complete()
        state = log.last_state()
        self.steps.step_count = state.count
        return state

    def close(self) -> None:
        """Stop the I/O threads and remove the scratch directory (unless a journaled run may resume from it)."""
        try:
            self.io.close()
        finally:
            for tier in self.tiers.all().values():
                tier.detach() if self.keep_scratch else tier.close()
            if self.policy.uses_disk and not self.keep_scratch:
                barrier(self.rt.world_group)
                if self.rt.rank == 0:
                    scratch.release(self.root)


def refuse_root_units(units: list[UnitSpec]) -> None:
    """The streamer runs the embedding, the blocks and the head in turn: a parameter outside them has no place in its order."""
    roles = [u.role for u in units]
    if "root" in roles:
        names = units[roles.index("root")].names
        raise BehemothError(f"offload streams the embedding, blocks and head; {names[0]} belongs to none of them", "train this model without offload")


def stream_order(units: list[UnitSpec], apart: list[bool] | None = None) -> tuple[list[UnitSpec], dict[int, tuple[int, ...]]]:
    """The units numbered as the streamer visits them (embedding, blocks, head: order.py), then each block's expert unit
    (ZeRO-3 with experts over ep splits it off its block, over the experts' group; `apart` marks them, by default those
    with a group); `reads`: the units an action needs besides its own (a block its experts, a tied head the embedding)."""
    apart = apart if apart is not None else [u.group is not None for u in units]
    dense = [u for u, e in zip(units, apart) if not e]
    experts = [u for u, e in zip(units, apart) if e]
    reads: dict[int, tuple[int, ...]] = {}
    for j, spec in enumerate(experts):
        block = units[units.index(spec) - 1]  # split_expert_units puts a block's experts right after it
        reads[dense.index(block)] = (len(dense) + j,)
    head = len(dense) - 1
    if dense[head].role == "head":  # a pipeline rank without the last stage holds no head
        reads[head] = tuple(dense.index(r) for r in dense[head].reads)
    return dense + experts, reads


class StreamedSteps:
    """The streamer as the model's executor (parallel/executor.py): every micro-batch through each unit while it is
    resident, the units in the policy's order. Under context parallelism (`context`) each micro-batch's tokens and
    targets are cut to this rank's shard first and embedded at their global positions (the units gather and reduce over
    dp x cp, `Runtime.data_group`, the ranks holding the same parameters)."""

    def __init__(self, sync: OffloadSync, others: list[GradSync] | None = None, context: ContextParallel | None = None) -> None:
        self.sync, self.others = sync, others or []  # others: resident parameters' syncs (a frozen base's adapters)
        self.context = context

    def shard(self, batches: Batch) -> tuple[Batch, Positions | None]:
        """This rank's tokens and targets of each micro-batch, and their global positions (cp > 1; else as they are)."""
        if self.context is None:
            return batches, None
        device = self.sync.rt.device
        cut = [self.context.shard(x.to(device), y.to(device)) for x, y in batches]
        return [(x, y) for x, y, _ in cut], {i: p for i, (_, _, p) in enumerate(cut)}

    def run(self, micro_batches: Batch, loss_fn: Callable, autocast: Callable[[], contextlib.AbstractContextManager]) -> torch.Tensor:
        """Forward and backward of every micro-batch, streaming the units in the policy's order (a frozen embedding
        takes no backward: its lookup has no gradient to give)."""
        sync = self.sync
        if sync.optimizer is None:
            raise RuntimeError("build the optimizer before training: the offload runtime steps units during the step")
        for other in self.others:  # the units' order interleaves micro-batches: resident gradients are reduced at finish
            other.begin_micro_batch(False)
        actions = make_order(sync.policy.order, sync.n_blocks, len(micro_batches))
        if sync.stores[0].frozen:
            actions = [a for a in actions if not (a.kind == "B" and a.unit == 0)]
        batches, positions = self.shard(micro_batches)
        return sync.streamer.train(actions, batches, loss_fn, autocast, positions)

    def forward_only(self, batches: Batch, loss_sum: Callable, autocast: Callable[[], contextlib.AbstractContextManager]) -> torch.Tensor:
        """[summed token loss, tokens] over `batches`, streaming each unit once (owed steps are applied as units arrive)."""
        device = self.sync.rt.device
        stats = torch.zeros(2, dtype=torch.float64, device=device)
        batches, positions = self.shard(batches)

        def add(i: int, logits: torch.Tensor) -> None:
            targets = batches[i][1].to(device)
            stats[0] += loss_sum(logits, targets).double()
            stats[1] += counted_targets(targets)

        self._stream([x for x, _ in batches], add, autocast, positions)
        return stats

    def logits(
        self, inputs: list[torch.Tensor], autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    ) -> list[torch.Tensor]:
        """The logits of each input (this rank's vocabulary shard under TP), every unit streamed once for all of them:
        a forward pass of a model that is never whole in memory (what offloaded inference needs)."""
        if self.context is not None:
            raise BehemothError("a context-parallel model holds 1/cp of each sequence's logits", "generate with parallel.cp=1")
        out: list[torch.Tensor | None] = [None] * len(inputs)

        def keep(i: int, logits: torch.Tensor) -> None:
            out[i] = logits

        self._stream(inputs, keep, autocast)
        return out

    def _stream(
        self, inputs: list[torch.Tensor], on_logits: Callable[[int, torch.Tensor], None], autocast: Callable, positions: Positions | None = None
    ) -> None:
        sync = self.sync
        sync.streamer.forward_only(forward_order(sync.n_blocks, len(inputs)), inputs, on_logits, autocast, positions)
        sync.io.drain()


def move_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Buffers (rotary frequencies and the like) stay resident, on the compute device."""
    for owner in model.modules():
        for name, buf in owner.named_buffers(recurse=False):
            if buf is not None and buf.device != device:
                owner._buffers[name] = buf.to(device)


def apply_offload(
    lm: CausalLM,
    units: list[UnitSpec],
    rt: Runtime,
    policy: OffloadPolicy,
    *,
    seed: int,
    activation: ActivationShape,
    tp: Any = None,
    copies: Callable[[str], int] | None = None,
    meter: CommMeter | None = None,
) -> OffloadSync:
    """Put `lm`'s units (ZeRO-3's, from `shard_parameters` on the meta model) on the policy's tiers, drawn from
    (seed, name) or read from the model's weights one unit at a time. `copies(name)`: the tp ranks holding an identical
    copy of a parameter's gradient, for the clipping norm (default: the dense split's, `tp.copies`)."""

    def drawn(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return draw_full(lm.init_spec(name), tuple(shape), seed, name)

    value: Callable[[str, tuple[int, ...]], torch.Tensor] = FolderWeights(lm.weights) if lm.weights else drawn

    return OffloadSync(lm, units, rt, policy, value=value, activation=activation, tp=tp, copies=copies, meter=meter)
