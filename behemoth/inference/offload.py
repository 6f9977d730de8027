"""Offloaded generation (ZeRO-Inference style): a model larger than memory generates with its blocks' weights streamed.

It runs on training's offload runtime: the model is cut into ZeRO-3's units (parallel/zero/units.py: the embedding,
one unit per block, the head), each unit's flat parameters live on a storage tier (parallel/zero/tiers.py: the embedding
and head on the compute device, every block in host memory or in a file of its own on disk) as a `UnitStore`
(offload/store.py), and training's streamer (offload/executor.py) runs each forward: a block's weights are fetched by
an I/O thread `prefetch` units ahead, installed as views just before the block runs and dropped right after. So
memory holds the resident parts, `prefetch + 1` blocks, the KV cache and the activations, whatever the depth. Every
forward reads every block once for the whole batch, so a larger batch amortises each read.

Under tensor parallelism the units are cut after the tensor-parallel split (on meta, as `parallelize` orders it), so
each rank stores and streams its own shard of every unit. The weights go onto their tiers one unit at a time from any
source (a DCP checkpoint, a Hugging Face folder through models/hf.py's safetensors reader, with a Mixtral's legacy
per-expert tensors stacked as training loads them, or drawn from the config's seed): the model is never whole.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from behemoth.comm import CommMeter
from behemoth.errors import BehemothError
from behemoth.inference.kv_cache import KVStorage, StepBatch
from behemoth.inference.loading import Source, inference_config
from behemoth.inference.runner import ModelRunner
from behemoth.models.causal_lm import CausalLM, build_causal_lm
from behemoth.models.init import FULL_NAME, FULL_SHAPE, draw_full

# The offload runtime's surface used here (one place to adapt when it moves): the policy, tiers, unit stores, I/O, streamer.
from behemoth.offload import OffloadPolicy
from behemoth.offload.executor import Streamer
from behemoth.offload.io import IOPool
from behemoth.offload.order import Action, forward_order
from behemoth.offload.store import Tiers, UnitStore, ValueSource, initial_shard
from behemoth.parallel.zero.tiers import TIER_NAMES, Tier, make_tier, tier_name
from behemoth.parallel.zero.units import UnitSpec, shard_parameters
from behemoth.topology import Runtime

if TYPE_CHECKING:
    from behemoth.parallel.tensor import TensorParallel
    from behemoth.plan import ParallelPlan

DEVICE, HOST, DISK = TIER_NAMES  # where a unit's weights live: the compute device, host memory, files
STREAM_TIERS = (HOST, DISK)


def generation_policy(tier: str, folder: str | Path | None = None, *, prefetch: int = 1, io_threads: int = 1) -> OffloadPolicy:
    """Training's OffloadPolicy for streamed generation: the blocks' weights on `tier` (host memory, or files under
    `folder`), `prefetch` units read ahead by `io_threads` threads (no gradients, no optimizer)."""
    name = tier_name(tier)  # the older spellings (cpu) too
    if name not in STREAM_TIERS or prefetch < 0 or io_threads < 1:
        raise BehemothError(
            f"offloaded generation with tier {tier!r}, prefetch {prefetch}, io_threads {io_threads}",
            "use a tier of host, disk (or cpu), prefetch >= 0 and io_threads >= 1",
        )
    if name == DISK and folder is None:
        raise BehemothError("disk offload needs a folder for the blocks' weights", "pass --offload-dir DIR")
    return OffloadPolicy(params=name, root=Path(folder).expanduser() if folder else None, prefetch=prefetch, io_threads=io_threads)


class UnitSource:
    """Full single-process tensors of one unit's parameters, read together: from a DCP checkpoint, an HF folder (the
    training loader's reader: a Mixtral's legacy per-expert tensors stacked) or drawn from (seed, name)."""

    def __init__(self, source: Source, lm: CausalLM) -> None:
        self.source, self.lm = source, lm
        weights = source.config.hf.weights
        self.files = sorted(Path(weights).expanduser().glob("*.safetensors")) if weights and source.checkpoint is None else []
        self.model_type = getattr(getattr(lm.module, "config", None), "model_type", None)

    def of(self, spec: UnitSpec) -> ValueSource:
        """The unit's values by single-process name (what `initial_shard` cuts this rank's shard from)."""
        shapes = {
            getattr(getattr(*locs[0]), FULL_NAME, n): getattr(getattr(*locs[0]), FULL_SHAPE, s)
            for n, s, locs in zip(spec.names, spec.shapes, spec.locations)
        }
        full = self.read(shapes)
        return lambda name, shape: full.pop(name)

    def read(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        if self.source.checkpoint is not None:
            from behemoth.faults.checkpoint import dcp_load  # DCP's index read through the allow-list

            state = {n: torch.empty(s) for n, s in shapes.items()}
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp_load({"model": state}, self.source.checkpoint, no_dist=True)
            return state
        if self.files:
            from behemoth.models.hf import stored_tensors

            out = dict(stored_tensors(self.files, set(shapes), self.model_type))
            missing = sorted(set(shapes) - set(out))
            if missing:
                raise BehemothError(f"hf.weights={self.source.config.hf.weights} lacks {missing[0]}", "save the whole model")
            return out
        seed = self.source.config.train.seed
        return {n: draw_full(self.lm.init_spec(n), tuple(s), seed, n) for n, s in shapes.items()}


class MeasuredTier:
    """A tier whose fetches are measured: bytes brought to compute, and the most bytes of fetched copies alive at once
    (a tier that aliases compute memory hands out its stored tensor: nothing extra is held)."""

    def __init__(self, tier: Tier) -> None:
        self.tier, self.fetched_bytes, self.held, self.peak_held = tier, 0, 0, 0
        self.lock = threading.RLock()  # a collection inside `fetch` may finalize an earlier copy on the same thread

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tier, name)

    def fetch(self, key: str) -> torch.Tensor:
        t = self.tier.fetch(key)
        n = t.numel() * t.element_size()
        with self.lock:
            self.fetched_bytes += n
            if self.tier.moves:
                self.held += n
                self.peak_held = max(self.peak_held, self.held)
                weakref.finalize(t, self.release, n)
        return t

    def release(self, n: int) -> None:
        with self.lock:
            self.held -= n


class NoSteps:
    """The streamer's step hooks for a model that only runs forward: no step is ever owed, no gradient completes."""

    def take_pending(self, store: UnitStore) -> None:
        return None

    def gradient_complete(self, store: UnitStore, shard: torch.Tensor, grad: torch.Tensor) -> None:
        raise RuntimeError("offloaded generation computes no gradients")


@dataclass
class StreamedModel:
    """This rank's part of a model whose units live on tiers (blocks streamed, embedding and head resident): what the
    generation runners need of a laid-out model (its CausalLM, runtime and tensor-parallel part; no pipeline)."""

    lm: CausalLM
    rt: Runtime
    tp: TensorParallel | None
    stores: list[UnitStore]
    streamer: Streamer
    io: IOPool
    blocks: MeasuredTier  # the blocks' tier, measured
    pipeline: None = None
    streamed_bytes: int = 0  # this rank's block weights on their tier: what every forward reads
    resident_bytes: int = 0  # the units kept on the compute device (embedding, head)

    def __post_init__(self) -> None:
        for s in self.stores:
            nbytes = s.tiers.params.nbytes(s.p_key)
            if s.spec.role == "block":
                self.streamed_bytes += nbytes
            else:
                self.resident_bytes += nbytes

    @property
    def module(self) -> torch.nn.Module:
        return self.lm.module

    def runner(self, storage: KVStorage) -> StreamedRunner:
        return StreamedRunner(self, storage)

    def close(self) -> None:
        """Stop the I/O threads; the blocks' files are removed (they are working copies, never a checkpoint)."""
        stores, self.stores = self.stores, []
        try:
            self.io.close()
        finally:
            for store in stores:
                store.close()


class StreamedRunner(ModelRunner):
    """A ModelRunner whose units the streamer brings in as each forward reaches them (prefetched ahead, dropped after)."""

    packs_rows = False  # its forward takes one sequence per row

    def __init__(self, model: StreamedModel, storage: KVStorage) -> None:
        super().__init__(model.lm, storage, tp=model.tp, device=model.rt.device)
        self.model, self.streamer = model, model.streamer
        self.actions = forward_order(len(self.blocks), 1)

    @torch.no_grad()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        step = self.storage.step(batch)
        model, positions = self.lm.module, step.batch.positions
        state: dict[str, Any] = {}

        def compute(a: Action) -> None:
            if a.unit == 0:
                state["h"] = self.view.embed(model, step.batch.ids, positions)
                state["ctx"] = self.view.context(model, state["h"], positions, step)
            elif a.kind == "F":
                state["h"] = self.view.block(self.blocks[a.unit - 1], state["h"], state["ctx"])
            else:
                state["logits"] = self.head(state["h"], batch.lengths)

        self.streamer.run(self.actions, compute)
        return state["logits"]

    def close(self) -> None:
        self.model.close()


def split_on_meta(lm: CausalLM, rt: Runtime, plan: ParallelPlan, timeout_s: float) -> TensorParallel | None:
    """Tensor parallelism, then experts, on the meta model (parallelize's steps 2-3, in its order): every split is
    decided before a unit is cut, so each rank's units hold only its part of every weight."""
    from behemoth.parallel.tensor import TensorPolicy, TPComm, apply_tensor_parallel
    from behemoth.parallelize import apply_experts

    meter, tp = CommMeter(), None
    if rt.dims.tp > 1:
        tp = apply_tensor_parallel(
            lm.module, TPComm.of(rt.group("tp"), meter), TensorPolicy(lm.tp_plan, plan.sequence_parallel, lm.transposed, lm.norms)
        )
        lm.after_tensor_parallel(rt.dims.tp)
    apply_experts(lm, plan, rt, meter, timeout_s)
    return tp


def unit_stores(units: list[UnitSpec], values: UnitSource, group: dist.ProcessGroup, device_tier: Tier, block_tier: MeasuredTier) -> list[UnitStore]:
    """Each unit's parameters (this rank's tensor-parallel part) put on its tier one unit at a time: blocks on the
    streamed tier, the embedding and head on the compute device, over `group` (generation's data-parallel group: this
    rank alone, so each unit is whole). The model's own parameters are removed."""
    stores = []
    for i, spec in enumerate(units):
        if spec.role == "root":
            raise BehemothError(
                f"offload streams the embedding, blocks and head; {spec.names[0]} belongs to none of them", "generate without --offload"
            )
        tier = block_tier if spec.role == "block" else device_tier
        store = UnitStore(i, spec, group, Tiers(tier, tier, tier))
        store.allocate_params(initial_shard(spec, store.layout, 0, values.of(spec)))
        for locations in spec.locations:
            for module, attr in locations:
                delattr(module, attr)
        stores.append(store)
    return stores


def load_offloaded(source: Source, rt: Runtime, policy: OffloadPolicy, *, tp: int = 1) -> StreamedModel:
    """This rank's model for generation with its blocks on `policy.params` (host memory or files under
    `policy.root`/rank<r>), streamed `policy.prefetch` units ahead; no gradient, no optimizer state."""
    cfg = inference_config(source.config, tp=tp)
    lm = build_causal_lm(cfg.model, cfg.hf)
    lm.weights = None  # read unit by unit below (whole, it would not fit)
    tensor = split_on_meta(lm, rt, cfg.parallel, cfg.run.timeout_s)
    units = shard_parameters(lm.module, rt.group("dp"), layers=lm.layers, tie_embeddings=lm.shape.tied)
    root = policy.root / f"rank{rt.rank}" if policy.root is not None else None
    block_tier = MeasuredTier(make_tier(policy.params, rt.device, root=root))
    stores = unit_stores(units, UnitSource(source, lm), rt.group("dp"), make_tier(DEVICE, rt.device), block_tier)
    lm.after_materialize(rt.device)  # buffers (rotary frequencies) on the device; no parameter is left on the module
    io = IOPool(policy.io_threads, max_in_flight=policy.prefetch + policy.io_threads + 1)
    reads = {len(units) - 1: tuple(units.index(r) for r in units[-1].reads)}
    streamer = Streamer(lm.module, lm.layers, stores, reads, io=io, prefetch=policy.prefetch, device=rt.device, hooks=NoSteps())
    return StreamedModel(lm, rt, tensor, stores, streamer, io, block_tier)
