"""ZeRO stages 1-3 behind the interface the engine uses for data parallelism and the optimizer.

`Zero` owns the flat groups (buckets at stages 1-2, units at stage 3), the gradient hooks, the
sharded optimizer and the checkpoint view. The loss is already divided by the global token count
(engine.train_step), so every collective sums.

Under a pipeline (`chunks`: the parameters of each stage this rank holds) there are no gradient
hooks: buckets never span two stages, and the executor calls `reduce_chunk(stage)` after each
backward (or weight-gradient) pass of that stage, so at stage 2 the stage's buckets are
reduce-scattered once per micro-batch, as without a pipeline; a weight-gradient pass of a
zero-bubble schedule writes `.grad` without the hooks firing, which is why the executor says when.
A parameter two stages share (a tied embedding, summed between the first and last stage before the
data-parallel reduction) or that no stage lists sits in a bucket of its own, reduced at `finish`.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from behemoth.comm import CommMeter, plan_buckets
from behemoth.errors import BehemothError
from behemoth.models.causal_lm import tied_names
from behemoth.models.init import FULL_NAME
from behemoth.parallel.clip import clip_grad_norm
from behemoth.parallel.tensor.layers import TP_LAYOUT
from behemoth.parallel.zero.groups import BufferMeter, FlatGroup, ReplicatedGroup
from behemoth.parallel.zero.optim import ShardedAdamW
from behemoth.parallel.zero.sharded import Stage3
from behemoth.parallel.zero.units import UnitSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MAX_BUCKETS_IN_FLIGHT = 2  # stage 2: full-size gradient buckets alive at once while reduce-scatters travel


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once, padding included)."""
    storages = {}
    for t in tensors:
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def comm_volume(ops: dict[str, dict[str, float]]) -> int:
    """Elements a rank moved, from `CommMeter.summary()`, counted as in the ZeRO paper: a reduce-scatter or
    all-gather counts the size of the full (unsharded) tensor, an all-reduce twice its size (it is both)."""
    count = {op: int(ops.get(op, {}).get("elements", 0)) for op in ("all_reduce", "reduce_scatter", "all_gather")}
    return 2 * count["all_reduce"] + count["reduce_scatter"] + count["all_gather"]


class Zero:
    """Sharded optimizer state (stage 1), gradients (2) and parameters (3) over the data-parallel group."""

    def __init__(self, model: nn.Module, group: dist.ProcessGroup, *, stage: int, bucket_mb: float, prefetch: int,
                 param_dtype: str, lr: float, betas: tuple[float, float], weight_decay: float,
                 units: list[UnitSpec] | None = None, chunks: dict[int, list[nn.Parameter]] | None = None,
                 meter: CommMeter | None = None) -> None:
        self.model, self.group, self.stage, self.meter = model, group, stage, meter
        if chunks is not None and stage == 3:
            raise ValueError("ZeRO stage 3 gathers parameters per block, not per pipeline stage; use stage 1 or 2 with a pipeline")
        self.chunk_groups: dict[int, list[ReplicatedGroup]] = {}  # pipeline stage -> its buckets (reduced by reduce_chunk)
        self.deferred: list[ReplicatedGroup] = []                  # buckets reduced once, at finish
        self.compute_dtype = DTYPES[param_dtype]
        self.sync = True
        self.aliases = tied_names(model)
        self.buffers = BufferMeter()
        self.in_flight: list[ReplicatedGroup] = []
        if stage == 3:
            if units is None:
                raise ValueError("stage 3 needs the units from shard_parameters(), called before materialize")
            self.stage3: Stage3 | None = Stage3(model, units, group, prefetch=prefetch, compute_dtype=self.compute_dtype, meter=meter)
            self.groups: list[FlatGroup] = list(self.stage3.units)
        else:
            self.stage3 = None
            self.groups = self._replicated_groups(int(bucket_mb * 2**20), chunks)
        self.optimizer = ShardedAdamW(self.groups, lr=lr, betas=betas, weight_decay=weight_decay)

    def _replicated_groups(self, bucket_bytes: int, chunks: dict[int, list[nn.Parameter]] | None) -> list[FlatGroup]:
        """Buckets of about `bucket_bytes`, in backward order, each with a hook per parameter (per pipeline stage
        without hooks, when `chunks` is given).

        A tensor-parallel parameter is this tp rank's local tensor: flat-sharding it over dp is sharding
        that local tensor, and its layout is the same on every tp rank, so buckets line up across tp.
        """
        named = list(self.model.named_parameters())
        frozen = [n for n, p in named if not p.requires_grad]
        undescribed = [n for n, p in named if hasattr(p, FULL_NAME) and not hasattr(p, TP_LAYOUT)]
        if frozen or undescribed:
            raise BehemothError(f"ZeRO stage {self.stage} needs every parameter trainable and whole or tensor-parallel "
                                f"(got {(frozen or undescribed)[0]})", "use parallel.zero_stage=0 for frozen parameters")
        names = {id(p): getattr(p, FULL_NAME, n) for n, p in named}

        def group(bucket: list[nn.Parameter]) -> ReplicatedGroup:
            return ReplicatedGroup(bucket, [names[id(p)] for p in bucket], self.group, stage=self.stage,
                                   compute_dtype=self.compute_dtype, meter=self.meter, buffers=self.buffers)

        params = [p for _, p in named]
        if chunks is None:
            groups = []
            for bucket in plan_buckets(reversed(params), bucket_bytes):
                g = group(bucket)
                for i, p in enumerate(bucket):
                    p.register_post_accumulate_grad_hook(self._grad_ready(g, i))
                groups.append(g)
            return groups
        uses = Counter(id(p) for stage_params in chunks.values() for p in {id(q): q for q in stage_params}.values())
        for stage, stage_params in sorted(chunks.items()):
            own = [p for p in params if uses[id(p)] == 1 and any(p is q for q in stage_params)]
            self.chunk_groups[stage] = [group(bucket) for bucket in plan_buckets(reversed(own), bucket_bytes)]
        self.deferred = [group([p]) for p in params if uses[id(p)] != 1]
        return [g for stage in sorted(self.chunk_groups) for g in self.chunk_groups[stage]] + self.deferred

    def _grad_ready(self, g: ReplicatedGroup, index: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if self.stage == 2:
                if g.pending is not None:  # the previous micro-batch's reduce-scatter of this bucket
                    g.wait()
                g.take_grad(p, index)
            elif not self.sync:
                return
            g.ready += 1
            if g.ready == len(g.params):
                self._launch(g)
        return hook

    def reduce_chunk(self, stage: int) -> None:
        """Under a pipeline: a backward or weight-gradient pass of `stage` has produced its gradients for one
        micro-batch. Stage 2 moves them into the stage's buckets and starts their reduce-scatters; stage 1 waits
        for `finish` (its gradients accumulate in place)."""
        if self.stage != 2:
            return
        for g in self.chunk_groups[stage]:
            g.wait()  # the previous micro-batch's reduce-scatter of this bucket
            for i, p in enumerate(g.params):
                if p.grad is not None:
                    g.take_grad(p, i)
            g.new_micro_batch()
            self._launch(g)

    def _launch(self, g: ReplicatedGroup) -> None:
        g.reduce_scatter_grads()
        self.in_flight.append(g)
        while self.stage == 2 and len(self.in_flight) > MAX_BUCKETS_IN_FLIGHT:
            self.in_flight.pop(0).wait()

    def set_sync(self, enabled: bool) -> None:
        """Stage 1 reduces only on the last micro-batch; stages 2-3 reduce every micro-batch (no full gradient is kept)."""
        self.sync = enabled
        if self.stage >= 2:
            self._drain()
        for g in self.groups:
            g.new_micro_batch()

    def _drain(self) -> None:
        if self.stage3 is not None:
            self.stage3.drain()
        for g in self.in_flight:
            g.wait()
        self.in_flight = []

    def finish(self) -> None:
        """After the last backward: every gradient shard is complete (buckets not yet sent go now, in a fixed order)."""
        if self.stage3 is not None:
            self.stage3.finish()
            return
        if self.stage == 2:
            for g in self.deferred:  # full gradients kept until now (a tied embedding, already summed over stages)
                for i, p in enumerate(g.params):
                    if p.grad is not None:
                        g.take_grad(p, i)
        for g in self.groups:
            g.reduce_scatter_grads()
        for g in self.groups:
            g.wait()
            g.new_micro_batch()
        self.in_flight = []

    def zero_grad(self) -> None:
        for g in self.groups:
            g.zero_grad()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global gradient norm from every rank's shard (one scalar all-reduce); clip if max_norm > 0."""
        return clip_grad_norm([("", g.grad_shard) for g in self.groups], max_norm, groups=[self.group], meter=self.meter)

    def grad_bytes(self) -> int:
        return held_bytes(g.grad_full if self.stage == 1 else g.grad_shard for g in self.groups)

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank really holds (distinct storages), and the peaks of its short-lived buffers."""
        params = [g.shard for g in self.groups] if self.stage3 else [p for p in self.model.parameters()]
        out = {"params": held_bytes(params), "grads": self.grad_bytes(), "optimizer": self.optimizer.state_bytes()}
        if self.stage3 is not None:
            out["gathered_peak"] = self.stage3.gathered_bytes.peak
            out["grad_buffers_peak"] = self.stage3.grad_bytes.peak
        elif self.stage == 2:
            out["grad_buffers_peak"] = self.buffers.peak
        return out

    def state_dict(self) -> dict[str, dict]:
        """Master weights and optimizer state as this rank's chunks, keyed by single-process names (for DCP)."""
        model, optim = self.optimizer.state_dict()
        for name, others in self.aliases.items():  # a tied weight appears under each of its names, as in model.state_dict()
            model.update(dict.fromkeys(others, model[name]))
        return {"model": model, "optim": optim}

    def after_load(self) -> None:
        """A checkpoint filled the master shards: rebuild the compute parameters from them."""
        self.optimizer.publish()
