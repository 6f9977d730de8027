"""The offload runtime: model states on tiers, streamed unit by unit, stepped where they live.

    units = shard_parameters(model, dp_group, layers=lm.layers)          # ZeRO-3's units, on meta
    sync = apply_offload(lm, units, rt, policy, seed=seed)                # a GradSync (parallel/sync.py)
    optimizer = sync.build_optimizer(settings)                            # the engine's, as for any sync
    loss = StreamedSteps(sync).run(micro_batches, loss_fn, autocast)      # the model's executor (parallel/executor.py)
    sync.clip_held_grads(coef, max_norm)                                  # after parallel/clip.py's global norm

Each rank keeps its 1/dp shard of every unit (the ZeRO-3 partition) on the tiers the policy names and
streams only that shard; the model is all-gathered unit by unit for compute.

The optimizer step happens where the state lives, unit by unit. Global-norm clipping needs the norm of
the whole gradient before any unit may step, so there are two ways (offload.step):

- fused (train.grad_clip = 0): a unit steps on an I/O thread as soon as its gradient is complete, during
  backward; no gradient outlives its unit's stay.
- deferred (exact clipping): a complete gradient goes to the gradient tier and its squared norm into a sum;
  after backward the model's clip (parallel/clip.py) turns the all-reduced sum into the clipping coefficient, and each unit
  takes its step (with that coefficient and the step's learning rate) when it is next fetched: at the next
  step's forward, at an evaluation, or at a flush before a checkpoint. No extra pass over the parameters:
  the cost is one write and one read of the gradient shard. The step is the same arithmetic as in memory
  (clip, then AdamW), so losses and weights equal in-memory training's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from behemoth.comm import CommMeter, barrier, broadcast_object
from behemoth.errors import BehemothError
from behemoth.models.causal_lm import CausalLM, counted_targets, tied_names
from behemoth.models.init import draw_full
from behemoth.offload import scratch
from behemoth.offload.budget import ActivationShape, MemoryPeak, fit_prefetch, in_memory_state_bytes, peak_bytes, unit_sizes
from behemoth.offload.executor import Batch, Streamer
from behemoth.offload.io import IOPool
from behemoth.offload.order import forward_order, make_order, plan_residencies, stores_grads
from behemoth.offload.store import PendingStep, Tiers, UnitStore, ValueSource, initial_shard, safetensors_source
from behemoth.offload.tiers import make_tier
from behemoth.parallel.clip import weighted_square
from behemoth.parallel.sync import AdamWSettings, GradSync, Optimizer, with_tied_names
from behemoth.parallel.zero.adam import make_adam
from behemoth.parallel.zero.layout import FlatLayout
from behemoth.parallel.zero.units import UnitSpec
from behemoth.topology import Runtime

MiB = 2**20
EIGHT_BIT = "adam8bit"  # the optimizer entries of 8-bit state in a checkpoint: loadable by the same offload layout only


@dataclass(frozen=True)
class OffloadPolicy:
    """Where parameters, gradients and optimizer state live, and how they stream."""

    params: str = "none"
    grads: str = "none"
    optimizer: str = "none"
    root: Path | None = None  # the scratch directory of the disk tier
    run_dir: str | None = None  # the run that claims it
    prefetch: int = 2
    io_threads: int = 2
    order: str = "harmony"
    fused: bool = False  # step during backward (no clipping) or deferred to the next fetch
    bits: int = 32
    max_memory_bytes: float | None = None  # the budget the prefetch depth and the jobs in flight must fit

    @classmethod
    def of(cls, offload: Any, *, run_dir: str | None, grad_clip: float) -> OffloadPolicy:
        """The policy an `offload` config section and the run ask for (offload.step=auto: fused without clipping)."""
        fused = steps_in_backward(offload.step, grad_clip)
        budget = offload.max_memory_gb * 2**30 if offload.max_memory_gb else None
        return cls(
            offload.params,
            offload.grads_tier,
            offload.optimizer,
            scratch.default_scratch(offload.dir, run_dir),
            run_dir,
            offload.prefetch,
            offload.io_threads,
            offload.order,
            fused,
            offload.optimizer_bits,
            budget,
        )

    @property
    def tiers(self) -> dict[str, str]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer}

    @property
    def uses_disk(self) -> bool:
        return "disk" in self.tiers.values()


def steps_in_backward(step: str, grad_clip: float) -> bool:
    """Whether offload.step (with train.grad_clip) fuses the optimizer step into backward: `fused`, or `auto` unclipped."""
    return step == "fused" or (step == "auto" and grad_clip == 0)


def fit_budget(
    policy: OffloadPolicy, layouts: list[FlatLayout], rank: int, act: ActivationShape, *, device_type: str, tied: bool
) -> tuple[int, int, MemoryPeak]:
    """(prefetch depth, jobs in flight, peak) for the policy within its budget; a one-line refusal when nothing fits."""
    sizes = unit_sizes(layouts, rank, policy.bits)
    plan = plan_residencies(make_order(policy.order, act.n_layer, act.microbatches), {len(layouts) - 1: (0,)} if tied else {})
    held = in_memory_state_bytes(sizes, policy.tiers, device_type, grads_stored=stores_grads(plan, deferred=not policy.fused))
    sharded = layouts[0].world > 1 if layouts else False
    unbounded = peak_bytes(
        sizes,
        act,
        prefetch=policy.prefetch,
        in_flight=policy.prefetch + policy.io_threads + 1,
        sharded=sharded,
        in_memory_states=held,
        tied=tied,
        io_threads=policy.io_threads,
    )
    if policy.max_memory_bytes is None:
        return policy.prefetch, policy.prefetch + policy.io_threads + 1, unbounded
    fit = fit_prefetch(
        sizes, act, policy.max_memory_bytes, prefetch=policy.prefetch, io_threads=policy.io_threads, sharded=sharded, in_memory_states=held, tied=tied
    )
    if fit is None:
        least = peak_bytes(sizes, act, prefetch=0, in_flight=1, sharded=sharded, in_memory_states=held, tied=tied, io_threads=1)
        mib = 2**20
        raise BehemothError(
            f"offload.max_memory_gb={policy.max_memory_bytes / 2**30:g} is smaller than one unit plus activations: "
            f"{least.total / mib:.1f} MiB at least (largest unit {least.resident / mib:.1f} + its step "
            f"{least.jobs / mib:.1f} + activations {least.activations / mib:.1f} + states kept in memory "
            f"{least.in_memory_states / mib:.1f} MiB)",
            "raise offload.max_memory_gb, put more states on disk, shorten train.micro_batch, or split layers with parallel.tp",
        )
    return fit


class OffloadSync(GradSync):
    """The gradient sync of a streamed model: units on tiers, gathered for compute, stepped where their state lives."""

    sharded = True

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
        meter: CommMeter | None = None,
    ) -> None:
        self.lm, self.model, self.rt, self.policy, self.tp, self.meter = lm, lm.module, rt, policy, tp, meter
        self.group = rt.group("dp")
        self.aliases = tied_names(self.model)
        roles = [u.role for u in units]
        if "root" in roles:
            names = units[roles.index("root")].names
            raise BehemothError(
                f"offload streams the embedding, blocks and head; {names[0]} belongs to none of them", "train this model without offload"
            )
        world = dist.get_world_size(self.group)
        layouts = [FlatLayout(u.names, u.shapes, world) for u in units]
        self.prefetch, in_flight, self.peak = fit_budget(
            policy, layouts, dist.get_rank(self.group), activation, device_type=rt.device.type, tied=bool(units[-1].reads)
        )
        if rt.device.type == "cpu":
            return_freed_memory()
        self.root = self._claim_scratch()
        self.tiers = Tiers(
            *(
                make_tier(name, rt.device, root=self.root / f"rank{rt.rank}" / kind)
                for name, kind in ((policy.params, "params"), (policy.grads, "grads"), (policy.optimizer, "optimizer"))
            )
        )
        self.io = IOPool(policy.io_threads, max_in_flight=in_flight)
        self.specs = units
        self.stores: list[UnitStore] = []
        self.step_count, self.norm_sq, self.coef = 0, torch.zeros((), dtype=torch.float32, device=rt.device), 1.0
        self.nonfinite = False  # a gradient of this step was not finite: no fused step from then on
        self.completed: list[UnitStore] = []
        self.optimizer: OffloadOptimizer | None = None
        self._materialize(value)
        reads = {len(units) - 1: tuple(units.index(r) for r in units[-1].reads)}
        self.streamer = Streamer(
            self.model, lm.layers, self.stores, reads, group=self.group, io=self.io, prefetch=self.prefetch, device=rt.device, hooks=self, meter=meter
        )
        self.counted = self._counters()

    def _claim_scratch(self) -> Path:
        """Rank 0 claims the scratch directory (refusing another run's, emptying a stale one of this run); all learn how it went."""
        root = self.policy.root or Path("offload-scratch")

        def claim() -> str | None:
            if not self.policy.uses_disk:
                return None
            try:
                note = scratch.claim(root, self.policy.run_dir)
            except BehemothError as err:
                return f"error: {err}"
            if note:
                print(f"behemoth: {note}", flush=True)
            return None

        error = broadcast_object(claim, self.rt.world_group, self.rt.rank == 0) if self.rt.world_size > 1 else claim()
        if error:
            raise BehemothError(error.removeprefix("error: "))
        return root

    def _materialize(self, value: ValueSource) -> None:
        """Each unit's shard drawn (or loaded) one unit at a time and put on its tier: the model is never whole in memory."""
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        for i, spec in enumerate(self.specs):
            store = UnitStore(i, spec, world, rank, self.tiers)
            store.allocate_params(initial_shard(spec, store.layout, rank, value))
            for locations in spec.locations:
                for module, attr in locations:
                    delattr(module, attr)
            self.stores.append(store)
        move_buffers(self.model, self.rt.device)

    # --- the GradSync protocol ---

    def zero_grad(self) -> None:
        """A new step: no gradient norm yet; the counters start again."""
        self.norm_sq.zero_()
        self.nonfinite = False
        self.completed = []
        self.counted = self._counters()

    def finish(self) -> None:
        """Every write-back and fused step of this step done."""
        self.io.drain()

    def grad_slices(self) -> list[tuple[str, torch.Tensor]]:
        return []  # gradients live on their tier: the norm comes from `clip`

    def build_optimizer(self, settings: AdamWSettings) -> OffloadOptimizer:
        """AdamW over the shards (its zero state allocated on the optimizer tier now)."""
        adam = make_adam(settings, self.policy.bits, self.rt.device)
        for store in self.stores:
            store.attach_optimizer(adam)
        self.optimizer = OffloadOptimizer(self, settings)
        return self.optimizer

    def model_state(self) -> dict[str, Any]:
        """Parameters by every single-process name, as chunks aliasing the stored shards (owed steps applied first)."""
        self.flush()
        out: dict[str, Any] = {}
        for store in self.stores:
            out.update(store.param_chunks())
        return with_tied_names(out, self.aliases)

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model states this rank keeps in memory (what is on disk is in `tier_bytes`)."""
        held = {kind: tier.resident_bytes() for kind, tier in self.tiers.all().items()}
        return {"params": held["params"], "grads": held["grads"]}

    def after_load(self, optimizer: Any) -> None:
        """A checkpoint was loaded into the stored shards: 8-bit moments quantized from the loaded float32 ones."""
        self.flush()
        for store in self.stores:
            store.pending, store.grad_waiting = None, False
        if self.optimizer is not None:
            self.optimizer.after_load()

    # --- clipping: the norm of gradients that live on their tier ---

    def held_grad_square(self) -> torch.Tensor:
        """The squared gradient norm summed as each unit's gradient completed (tensor-parallel copies weighted)."""
        return self.norm_sq

    def clip_held_grads(self, coef: float, max_norm: float) -> None:
        """The clipping coefficient each unit's deferred step applies."""
        if self.policy.fused and max_norm > 0:
            raise BehemothError(
                f"train.grad_clip={max_norm} with a fused offload step: units stepped before the norm was known",
                "set offload.step=deferred (or auto), or train.grad_clip=0",
            )
        self.coef = coef if max_norm > 0 else 1.0

    # --- hooks of the streamer ---

    def take_pending(self, store: UnitStore) -> PendingStep | None:
        step, store.pending = store.pending, None
        if step is not None:
            store.grad_waiting = False
        return step

    def gradient_complete(self, store: UnitStore, shard: torch.Tensor, grad: torch.Tensor) -> None:
        """A unit's gradient is whole (summed over micro-batches and ranks): count its norm, then step it or keep it."""
        if self.tp is not None:
            self.tp.finish_grads([(store.layout.names[pc.index], grad[pc.shard_offset : pc.shard_offset + pc.numel]) for pc in store.raw_pieces])
        square = self._weighted_square(store, grad)
        self.norm_sq += square
        if self.policy.fused:
            self.nonfinite = self.nonfinite or not bool(torch.isfinite(square))
            if self.nonfinite:  # the step's norm will not be finite: it applies to no further unit (the engine skips it)
                return
            step = PendingStep(self.optimizer.lr, 1.0, self.step_count + 1)
            self.io.submit(store.index, store.apply_step, shard, grad, step)
        else:
            store.grad_waiting = True
            self.completed.append(store)
            self.io.submit(store.index, store.save_grad, grad)

    def _weighted_square(self, store: UnitStore, grad: torch.Tensor) -> torch.Tensor:
        """|g|^2 of this rank's shard, each piece weighted 1 / (tensor-parallel ranks holding a copy of it), as clip weighs."""
        if self.tp is None:
            return weighted_square([(grad, 1.0)])
        return weighted_square(
            [(grad[pc.shard_offset : pc.shard_offset + pc.numel], 1.0 / self.tp.copies(store.layout.names[pc.index])) for pc in store.raw_pieces],
            grad.device,
        )

    # --- the optimizer's side ---

    def optimizer_step(self, lr: float) -> None:
        """After clipping: fused steps already ran; deferred ones are owed by every unit, applied at its next fetch."""
        self.step_count += 1
        if not self.policy.fused:
            for store in self.completed:
                store.pending = PendingStep(lr, self.coef, self.step_count)
        self.completed = []

    def flush(self) -> None:
        """Apply every owed step now (before a checkpoint reads the stored shards)."""
        for store in self.stores:
            step = self.take_pending(store)
            if step is not None:
                self.io.submit(store.index, store.load, step, False)
        self.io.drain()

    # --- measurements ---

    def _counters(self) -> dict[str, tuple[int, int]]:
        return {kind: (tier.read_bytes, tier.written_bytes) for kind, tier in self.tiers.all().items()}

    def step_metrics(self) -> dict[str, float]:
        """Bytes read and written this step per kind of state and tier, and the time compute waited for I/O."""
        out: dict[str, float] = {}
        for kind, tier in self.tiers.all().items():
            r0, w0 = self.counted[kind]
            out[f"offload_read_mb_{kind}_{tier.name}"] = (tier.read_bytes - r0) / MiB
            out[f"offload_written_mb_{kind}_{tier.name}"] = (tier.written_bytes - w0) / MiB
        out["offload_io_wait_s"] = self.io.wait_s
        out["offload_activations_mb"] = self.streamer.peak_activation_bytes / MiB
        self.io.wait_s = 0.0
        return out

    def step_bytes(self) -> dict[str, tuple[int, int]]:
        """(read, written) bytes per kind of state since the step began."""
        return {
            kind: (tier.read_bytes - self.counted[kind][0], tier.written_bytes - self.counted[kind][1]) for kind, tier in self.tiers.all().items()
        }

    def close(self) -> None:
        """Stop the I/O threads and remove the scratch directory (it is never a checkpoint)."""
        try:
            self.io.close()
        finally:
            for tier in self.tiers.all().values():
                tier.close()
            if self.policy.uses_disk:
                barrier(self.rt.world_group)
                if self.rt.rank == 0:
                    scratch.release(self.root)


class StreamedSteps:
    """The streamer as the model's executor (parallel/executor.py): every micro-batch through each unit while it is
    resident, the units in the policy's order."""

    def __init__(self, sync: OffloadSync) -> None:
        self.sync = sync

    def run(self, micro_batches: Batch, loss_fn: Callable, autocast: Callable[[], contextlib.AbstractContextManager]) -> torch.Tensor:
        """Forward and backward of every micro-batch, streaming the units in the policy's order."""
        sync = self.sync
        if sync.optimizer is None:
            raise RuntimeError("build the optimizer before training: the offload runtime steps units during the step")
        actions = make_order(sync.policy.order, len(sync.stores) - 2, len(micro_batches))
        return sync.streamer.train(actions, micro_batches, loss_fn, autocast)

    def forward_only(self, batches: Batch, loss_sum: Callable, autocast: Callable[[], contextlib.AbstractContextManager]) -> torch.Tensor:
        """[summed token loss, tokens] over `batches`, streaming each unit once (owed steps are applied as units arrive)."""
        device = self.sync.rt.device
        stats = torch.zeros(2, dtype=torch.float64, device=device)

        def add(i: int, logits: torch.Tensor) -> None:
            targets = batches[i][1].to(device)
            stats[0] += loss_sum(logits, targets).double()
            stats[1] += counted_targets(targets)

        self._stream([x for x, _ in batches], add, autocast)
        return stats

    def logits(
        self, inputs: list[torch.Tensor], autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    ) -> list[torch.Tensor]:
        """The logits of each input (this rank's vocabulary shard under TP), every unit streamed once for all of them:
        a forward pass of a model that is never whole in memory (what offloaded inference needs)."""
        out: list[torch.Tensor | None] = [None] * len(inputs)

        def keep(i: int, logits: torch.Tensor) -> None:
            out[i] = logits

        self._stream(inputs, keep, autocast)
        return out

    def _stream(self, inputs: list[torch.Tensor], on_logits: Callable[[int, torch.Tensor], None], autocast: Callable) -> None:
        sync = self.sync
        sync.streamer.forward_only(forward_order(len(sync.stores) - 2, len(inputs)), inputs, on_logits, autocast)
        sync.io.drain()


class OffloadOptimizer(Optimizer):
    """AdamW over every unit's shard, stepped by the runtime where the state lives (fused or deferred)."""

    def __init__(self, sync: OffloadSync, settings: AdamWSettings) -> None:
        self.sync, self.settings = sync, settings
        self.param_groups = [{"lr": settings.lr}]
        self.step_tensor = torch.tensor(0.0)

    @property
    def lr(self) -> float:
        return self.param_groups[0]["lr"]

    def step(self) -> None:
        self.sync.optimizer_step(self.lr)

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        """Adam state by single-process name: float32 moments as chunks; 8-bit state as it is stored (codes and block
        scales of this rank's shard, keyed by the data-parallel layout, `EIGHT_BIT`), so it stays 8-bit on disk."""
        sync = self.sync
        sync.flush()
        self.step_tensor.fill_(float(sync.step_count))
        out: dict[str, dict[str, torch.Tensor]] = {}
        world, rank = dist.get_world_size(sync.group), dist.get_rank(sync.group)
        for store in sync.stores:
            if store.adam.bits == 32:
                m, v = (sync.tiers.optimizer.view(store.state_keys[k]) for k in ("m", "v"))
                out.update(store.moment_chunks(m, v, self.step_tensor))
            else:
                out[EIGHT_BIT] = {"step": self.step_tensor}
                out[f"{EIGHT_BIT}.dp{world}.rank{rank}.unit{store.index}"] = {
                    k: sync.tiers.optimizer.view(key) for k, key in store.state_keys.items()
                }
        return out

    def after_load(self) -> None:
        """The step count (moments were loaded where they are stored, 8-bit ones as 8-bit)."""
        sync = self.sync
        sync.step_count = int(self.step_tensor.item())

    def state_bytes(self) -> int:
        return self.sync.tiers.optimizer.resident_bytes()


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_freed_memory(threshold: int = 2**20) -> bool:
    """glibc: give every allocation of `threshold` bytes or more its own mapping, unmapped when freed.

    The runtime allocates and frees unit-sized buffers all the time, on several threads; glibc's adaptive threshold
    would soon serve them from its heaps (one per thread), which keep freed memory, so the resident set would grow
    past the budget with memory nobody uses. On a GPU the caching allocator owns device memory and this is moot.
    """
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


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
    meter: CommMeter | None = None,
) -> OffloadSync:
    """Put `lm`'s units (ZeRO-3's, from `shard_parameters` on the meta model) on the policy's tiers, drawn from
    (seed, name) or read from the model's weights one unit at a time."""
    if lm.weights:
        value = safetensors_source(lm.weights)
    else:

        def value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return draw_full(lm.init_spec(name), tuple(shape), seed, name)

    return OffloadSync(lm, units, rt, policy, value=value, activation=activation, tp=tp, meter=meter)
