"""One unit's states on their tiers: this rank's parameter shard, gradient shard and optimizer state.

A unit is ZeRO-3's (parallel/zero/units.py: the embedding, a block, the head), laid out flat and cut into
equal shards over the data-parallel group (parallel/zero/layout.py), so each rank streams only its shard
and the model is all-gathered unit by unit for compute, by the unit runtime ZeRO-3 runs (`UnitRuntime`).
The store's methods that move bytes run on the I/O threads (`load`, `apply_step`, `save_grad`); nothing else touches a unit's tiers while they run,
because the I/O pool orders a unit's jobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from behemoth.comm import CommMeter
from behemoth.errors import BehemothError
from behemoth.models.init import FULL_NAME, FULL_SHAPE, TAKE_LOCAL
from behemoth.offload.frozen import FrozenShard
from behemoth.offload.journal import Journal
from behemoth.parallel.chunked import ChunkedTensor
from behemoth.parallel.zero.adam import Adam8bit, AdamFP32, shard_pieces
from behemoth.parallel.zero.layout import FlatLayout
from behemoth.parallel.zero.optim import moment_chunks, shard_chunks
from behemoth.parallel.zero.tiers import Tier
from behemoth.parallel.zero.units import UnitRuntime, UnitSpec

ValueSource = Callable[[str, tuple[int, ...]], torch.Tensor]  # (single-process name, full shape) -> full float32 tensor


@dataclass(frozen=True)
class Tiers:
    """Where each kind of state lives."""

    params: Tier
    grads: Tier
    optimizer: Tier

    def all(self) -> dict[str, Tier]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer}


class TierMeter:
    """Bytes each kind of state's tier moved since the step began, from the tiers' own counters."""

    def __init__(self, tiers: Tiers) -> None:
        self.tiers = tiers
        self.start()

    def start(self) -> None:
        """A new step: count from here."""
        self.counted = {kind: (tier.read_bytes, tier.written_bytes) for kind, tier in self.tiers.all().items()}

    def moved(self) -> dict[str, tuple[int, int]]:
        """(read, written) bytes per kind of state since `start`."""
        return {kind: (t.read_bytes - self.counted[kind][0], t.written_bytes - self.counted[kind][1]) for kind, t in self.tiers.all().items()}

    def metrics(self) -> dict[str, float]:
        """`offload_read_mb_<state>_<tier>` and `offload_written_mb_<state>_<tier>` since `start`, in MiB."""
        out: dict[str, float] = {}
        for kind, (read, written) in self.moved().items():
            name = self.tiers.all()[kind].name
            out[f"offload_read_mb_{kind}_{name}"] = read / 2**20
            out[f"offload_written_mb_{kind}_{name}"] = written / 2**20
        return out


@dataclass(frozen=True)
class PendingStep:
    """An optimizer step a unit still owes (deferred: applied when it is next fetched)."""

    lr: float
    coef: float  # the global-norm clipping coefficient of that step
    step: int  # the optimizer's step count after it


class UnitStore(UnitRuntime):
    """A ZeRO-3 unit whose shard of parameters, gradients and optimizer state lives on tiers, by key."""

    def __init__(
        self,
        index: int,
        spec: UnitSpec,
        group: dist.ProcessGroup,
        tiers: Tiers,
        meter: CommMeter | None = None,
        *,
        compute_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.index, self.spec, self.tiers, self.group, self.meter = index, spec, tiers, group, meter
        self.compute_dtype = compute_dtype  # the gathered parameters and the gradient; masters and moments stay float32
        rank = self.rank = dist.get_rank(group)
        self.layout = FlatLayout(spec.names, spec.shapes, dist.get_world_size(group))
        self.raw_pieces = self.layout.pieces(rank)
        self.pieces = shard_pieces(self.layout, rank)
        self.shard_size = self.layout.shard_size
        self.p_key, self.g_key = f"p.{index}", f"g.{index}"
        self.adam: AdamFP32 | Adam8bit | None = None
        self.state_keys: dict[str, str] = {}
        self.grad_waiting = False  # a gradient (partial, or complete and deferred) is on the gradient tier
        self.pending: PendingStep | None = None
        self.frozen = spec.frozen  # a LoRA base: read-only, no gradient, no optimizer state
        self.source: FrozenShard | None = None  # a frozen unit read straight from its model folder at every fetch
        self.journal: Journal | None = None  # offload.commit=journal: the redo log its steps are written through

    @property
    def stored_dtype(self) -> torch.dtype:
        """The parameter shard's dtype on its tier: float32 masters; a frozen unit (no step) in the compute dtype, as ZeRO-3."""
        return self.compute_dtype if self.frozen else torch.float32

    def allocate_params(self, initial: torch.Tensor) -> None:
        """Create the unit's parameter shard on its tier, holding `initial`."""
        self.tiers.params.allocate(self.p_key, self.shard_size, self.stored_dtype)
        self.tiers.params.store(self.p_key, initial.to(self.stored_dtype))

    def reopen_params(self) -> None:
        """The unit's parameter shard as a journaled scratch left it (a resume: nothing drawn or written)."""
        self.tiers.params.reopen(self.p_key, self.shard_size, self.stored_dtype)  # type: ignore[attr-defined]

    def compute_shard(self, shard: torch.Tensor) -> torch.Tensor:
        """The fetched shard in the compute dtype, the one all-gathered and computed with (bf16 from the float32 master,
        as ZeRO-3 keeps its compute copy; the shard itself when the dtypes agree)."""
        return shard if shard.dtype == self.compute_dtype else shard.to(self.compute_dtype)

    def attach_optimizer(self, adam: AdamFP32 | Adam8bit) -> None:
        """The optimizer that steps this unit; its zero state is created on the optimizer tier now (a frozen unit: none)."""
        if self.frozen:
            return
        self.adam = adam
        spec = adam.state_spec(self.pieces, self.shard_size)
        self.state_keys = {name: f"{name}.{self.index}" for name in spec}
        for name, (numel, dtype) in spec.items():
            if self.journal is not None and self.journal.reopening:
                self.tiers.optimizer.reopen(self.state_keys[name], numel, dtype)  # type: ignore[attr-defined]
            else:
                self.tiers.optimizer.allocate(self.state_keys[name], numel, dtype)

    # --- jobs: run on an I/O thread ---

    def load(self, pending: PendingStep | None, with_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The parameter shard (stepped first if a step is owed) and, if asked, the gradient waiting on its tier."""
        if self.source is not None:
            return self.source.read().to(self.tiers.params.device, self.stored_dtype), None
        p = self.tiers.params.fetch(self.p_key)
        if pending is not None:
            self.apply_step(p, self.tiers.grads.fetch(self.g_key), pending)
        g = self.tiers.grads.fetch(self.g_key) if with_grad else None
        return p, g

    def apply_step(self, p: torch.Tensor, g: torch.Tensor, step: PendingStep) -> None:
        """AdamW where the state lives: read it, update parameters and state, write both back. A bf16 gradient is clipped in
        its dtype and stepped in float32, as ZeRO-3 clips (parallel/clip.py) and steps (zero/optim.py) it."""
        state = {name: self.tiers.optimizer.fetch(key) for name, key in self.state_keys.items()}
        coef = step.coef
        if g.dtype != torch.float32:
            if coef != 1.0:
                g.mul_(torch.tensor(coef, dtype=torch.float32).to(g.dtype))
            g, coef = g.float(), 1.0
        self.adam.step(p, g, state, self.pieces, lr=step.lr, coef=coef, step=step.step)
        if self.journal is not None:  # offload.commit=journal: new files beside the old, recorded, renamed in
            self.journal.write_unit(self.p_key, p, {name: (key, state[name]) for name, key in self.state_keys.items()}, self.index)
            return
        self.tiers.params.store(self.p_key, p)
        for name, key in self.state_keys.items():
            self.tiers.optimizer.store(key, state[name])

    def save_grad(self, g: torch.Tensor) -> None:
        if not self.tiers.grads.has(self.g_key):  # created on first use: many plans never need it
            self.tiers.grads.allocate(self.g_key, self.shard_size, self.compute_dtype)
        self.tiers.grads.store(self.g_key, g)

    # --- checkpoints: views of the stored data (memory maps for files) ---

    def param_chunks(self) -> dict[str, ChunkedTensor]:
        """Every parameter of the unit as this rank's chunks of its full tensor, aliasing the stored shard."""
        return shard_chunks(self.layout, self.rank, self.tiers.params.view(self.p_key))

    def moment_chunks(self, m: torch.Tensor, v: torch.Tensor, step: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
        """Adam state by parameter name (float32 moments as chunks), as the in-memory optimizers write it."""
        return moment_chunks(self.layout, self.rank, m, v, step)

    def close(self) -> None:
        for tier in self.tiers.all().values():
            for key in (self.p_key, self.g_key, *self.state_keys.values()):
                tier.drop(key)


def initial_shard(spec: UnitSpec, layout: FlatLayout, rank: int, value: ValueSource) -> torch.Tensor:
    """This rank's shard of the unit's initial parameters: each full tensor from `value`, cut as ZeRO-3 and
    tensor parallelism cut it (`shard_parameters` left a meta parameter that knows its piece)."""
    shard = torch.zeros(layout.shard_size)
    for pc in layout.pieces(rank):
        meta = getattr(*spec.locations[pc.index][0])
        name = getattr(meta, FULL_NAME, spec.names[pc.index])
        full = value(name, getattr(meta, FULL_SHAPE, spec.shapes[pc.index]))
        shard[pc.shard_offset : pc.shard_offset + pc.numel] = getattr(meta, TAKE_LOCAL, lambda t: t)(full).reshape(-1)
    return shard


def safetensors_source(folder: str) -> ValueSource:
    """Parameters read one at a time from a save_pretrained folder's safetensors (never the whole model at once)."""
    from safetensors import safe_open

    files = sorted(Path(folder).expanduser().glob("*.safetensors"))
    if not files:
        raise BehemothError(f"hf.weights={folder} holds no *.safetensors file", "save the model with save_pretrained(..., safe_serialization=True)")
    where = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            where.update(dict.fromkeys(st.keys(), f))

    def value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in where:
            raise BehemothError(f"hf.weights={folder} lacks parameter {name}", "save the whole model")
        with safe_open(str(where[name]), framework="pt") as st:
            return st.get_tensor(name).float()

    return value
