"""ZeRO stages 1-3 as gradient syncs (parallel/sync.py), one small class per stage.

`ZeroSync` owns the flat groups (buckets at stages 1-2, units at stage 3), their sharded optimizer and
their checkpoint view; the stages differ in what a gradient does on its way to its shard:

- `ZeroStage1`: gradients accumulate in full buckets; on the last micro-batch a full bucket is
  reduce-scattered in place.
- `ZeroStage2`: a gradient is added into its bucket and dropped; a full bucket is reduce-scattered on
  every micro-batch and freed (at most MAX_BUCKETS_IN_FLIGHT alive).
- `ZeroStage3`: parameters are shards too; units are gathered around their forward and backward and
  their gradients reduce-scattered by the gather's backward (sharded.py).

Under a pipeline (`stage_params`: the parameters of each pipeline stage this rank holds) there are no
gradient hooks at stages 1-2: buckets never span two pipeline stages, and the executor calls
`stage_done(stage)` after each backward (or weight-gradient) pass of that stage, so at stage 2 that
stage's buckets are reduce-scattered once per micro-batch, as without a pipeline; a weight-gradient
pass of a zero-bubble schedule writes `.grad` without the hooks firing, which is why the executor says
when. A parameter two pipeline stages share (a tied embedding, summed between the first and last stage
before the data-parallel reduction) or that no stage lists sits in a bucket of its own, reduced at `finish`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from behemoth.comm import CommMeter, plan_buckets
from behemoth.errors import BehemothError
from behemoth.models.causal_lm import tied_names
from behemoth.models.init import FULL_NAME
from behemoth.parallel.expert.layout import EXPERT_LAYOUT
from behemoth.parallel.sync import AdamWSettings, GradSync, with_tied_names
from behemoth.parallel.tensor.layers import TP_LAYOUT
from behemoth.parallel.zero.groups import AccumulatingBucket, BufferMeter, FlatGroup, ReplicatedGroup, StreamingBucket
from behemoth.parallel.zero.optim import ShardedAdamW, master_chunks
from behemoth.parallel.zero.sharded import Stage3
from behemoth.parallel.zero.tiers import make_tier, tier_name
from behemoth.parallel.zero.units import UnitSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MAX_BUCKETS_IN_FLIGHT = 2  # stage 2: full-size gradient buckets alive at once while reduce-scatters travel


@dataclass(frozen=True)
class ZeroPolicy:
    """ZeRO's settings: the stage, the bucket size (stages 1-2), the blocks gathered ahead (stage 3), the compute dtype,
    and the tier of the optimizer's moments (stages 1-2: `host` is ZeRO-Offload; stage 3 streams through offload/)."""

    stage: Literal[1, 2, 3]
    bucket_mb: float = 25.0
    prefetch: int = 1
    param_dtype: str = "fp32"
    optimizer_tier: str = "device"


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


class ZeroSync(GradSync):
    """Sharded optimizer state (and gradients, and parameters) over a data-parallel group."""

    sharded = True
    groups: list[FlatGroup]

    @property
    def gathers_parameters(self) -> bool:
        return self.policy.stage == 3

    def __init__(
        self, model: nn.Module, group: dist.ProcessGroup, policy: ZeroPolicy, meter: CommMeter | None, select: Callable[[str], bool] | None = None
    ) -> None:
        self.model, self.group, self.policy, self.meter = model, group, policy, meter
        self.select = select or (lambda name: True)
        self.compute_dtype = DTYPES[policy.param_dtype]
        self.aliases = {k: v for k, v in tied_names(model).items() if self.select(k)}

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The model's parameters this sync keeps (all, or those `select` accepts)."""
        return [(n, p) for n, p in self.model.named_parameters() if self.select(n)]

    def zero_grad(self) -> None:
        for g in self.groups:
            g.zero_grad()

    def grad_slices(self) -> list[tuple[str, torch.Tensor]]:
        """(single-process name, this rank's slice of its summed gradient) for every piece this rank owns."""
        return [
            (g.layout.names[pc.index], g.grad_shard[pc.shard_offset : pc.shard_offset + pc.numel])
            for g in self.groups
            for pc in g.layout.pieces(g.rank)
        ]

    def build_optimizer(self, settings: AdamWSettings) -> ShardedAdamW:
        """The sharded AdamW, its moments on the policy's optimizer tier (device or host)."""
        device = self.groups[0].master.device if self.groups else torch.device("cpu")
        return ShardedAdamW(self.groups, settings, make_tier(self.policy.optimizer_tier, device))

    def model_state(self) -> dict[str, Any]:
        """Master weights as this rank's chunks, by every name a parameter has (a tied weight under each)."""
        return with_tied_names(master_chunks(self.groups), self.aliases)

    def after_load(self, optimizer: Any) -> None:
        """A checkpoint filled the master shards: rebuild the compute parameters from them."""
        optimizer.publish()

    def param_bytes(self) -> int:
        return held_bytes(p for _, p in self.named_parameters())

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank really holds (distinct storages)."""
        return {"params": self.param_bytes(), "grads": held_bytes(g.grad_shard for g in self.groups)}


def plan_stage_buckets(
    params: list[nn.Parameter], stage_params: dict[int, list[nn.Parameter]], bucket_bytes: int
) -> tuple[dict[int, list[list[nn.Parameter]]], list[list[nn.Parameter]]]:
    """Under a pipeline: each stage's buckets (backward order) of the `params` only it uses, and a bucket apiece for
    those two stages share or none lists. Pure (shapes only): the planner lays the buckets out with it too."""
    mine = {id(p) for p in params}
    stage_params = {stage: [p for p in ps if id(p) in mine] for stage, ps in stage_params.items()}
    uses = Counter(id(p) for ps in stage_params.values() for p in {id(q): q for q in ps}.values())
    per_stage = {
        stage: plan_buckets(reversed([p for p in params if uses[id(p)] == 1 and any(p is q for q in ps)]), bucket_bytes)
        for stage, ps in sorted(stage_params.items())
    }
    return per_stage, [[p] for p in params if uses[id(p)] != 1]


class ZeroStage1(ZeroSync):
    """Optimizer state sharded; full gradients accumulate in buckets and are reduce-scattered on the last micro-batch."""

    bucket_type: type[ReplicatedGroup] = AccumulatingBucket

    def __init__(
        self,
        model: nn.Module,
        group: dist.ProcessGroup,
        policy: ZeroPolicy,
        *,
        stage_params: dict[int, list[nn.Parameter]] | None = None,
        meter: CommMeter | None = None,
        select: Callable[[str], bool] | None = None,
    ) -> None:
        super().__init__(model, group, policy, meter, select)
        self.last = True
        self.buffers = BufferMeter()
        self.in_flight: list[ReplicatedGroup] = []
        self.stage_buckets: dict[int, list[ReplicatedGroup]] = {}  # pipeline stage -> its buckets (reduced by stage_done)
        self.deferred: list[ReplicatedGroup] = []  # buckets reduced once, at finish
        self.groups = self._buckets(int(policy.bucket_mb * 2**20), stage_params)

    def _buckets(self, bucket_bytes: int, stage_params: dict[int, list[nn.Parameter]] | None) -> list[FlatGroup]:
        """Buckets of about `bucket_bytes`, in backward order, each with a hook per parameter (per pipeline stage
        without hooks, when `stage_params` is given).

        A tensor-parallel parameter is this tp rank's local tensor: flat-sharding it over dp is sharding
        that local tensor, and its layout is the same on every tp rank, so buckets line up across tp.
        """
        named = self.named_parameters()
        frozen = [n for n, p in named if not p.requires_grad]
        undescribed = [n for n, p in named if hasattr(p, FULL_NAME) and not hasattr(p, TP_LAYOUT) and not hasattr(p, EXPERT_LAYOUT)]
        if frozen or undescribed:
            raise BehemothError(
                f"ZeRO stage {self.policy.stage} needs every parameter trainable and whole or tensor-parallel (got {(frozen or undescribed)[0]})",
                "use parallel.zero_stage=0 for frozen parameters",
            )
        names = {id(p): getattr(p, FULL_NAME, n) for n, p in named}

        def bucket(params: list[nn.Parameter]) -> ReplicatedGroup:
            return self.bucket_type(
                params, [names[id(p)] for p in params], self.group, compute_dtype=self.compute_dtype, meter=self.meter, buffers=self.buffers
            )

        params = [p for _, p in named]
        if stage_params is None:
            groups = []
            for b in plan_buckets(reversed(params), bucket_bytes):
                g = bucket(b)
                for i, p in enumerate(b):
                    p.register_post_accumulate_grad_hook(self._grad_ready(g, i))
                groups.append(g)
            return groups
        per_stage, shared = plan_stage_buckets(params, stage_params, bucket_bytes)
        self.stage_buckets = {stage: [bucket(b) for b in buckets] for stage, buckets in per_stage.items()}
        self.deferred = [bucket(b) for b in shared]
        return [g for stage in sorted(self.stage_buckets) for g in self.stage_buckets[stage]] + self.deferred

    def _grad_ready(self, g: ReplicatedGroup, index: int) -> Callable[[torch.Tensor], None]:
        def hook(p: torch.Tensor) -> None:
            if self.take(g, p, index):
                g.ready += 1
                if g.ready == len(g.params):
                    self._launch(g)

        return hook

    def take(self, g: ReplicatedGroup, p: torch.Tensor, index: int) -> bool:
        """A gradient arrived in `.grad`; whether it counts towards launching its bucket now (stage 1: last micro-batch only)."""
        return self.last

    def _launch(self, g: ReplicatedGroup) -> None:
        g.reduce_scatter_grads()
        self.in_flight.append(g)

    def begin_micro_batch(self, last: bool) -> None:
        """Stage 1 reduces only on the last micro-batch."""
        self.last = last
        for g in self.groups:
            g.new_micro_batch()

    def finish(self) -> None:
        """After the last backward: every gradient shard is complete (buckets not yet sent go now, in a fixed order)."""
        for g in self.groups:
            g.reduce_scatter_grads()
        for g in self.groups:
            g.wait()
            g.new_micro_batch()
        self.in_flight = []

    def state_bytes(self) -> dict[str, int]:
        return {"params": self.param_bytes(), "grads": held_bytes(g.grad_full for g in self.groups)}


class ZeroStage2(ZeroStage1):
    """Gradients sharded too: every micro-batch's gradients are reduce-scattered bucket by bucket and dropped."""

    bucket_type = StreamingBucket

    def take(self, g: StreamingBucket, p: torch.Tensor, index: int) -> bool:
        if g.pending is not None:  # the previous micro-batch's reduce-scatter of this bucket
            g.wait()
        g.take_grad(p, index)
        return True

    def _launch(self, g: ReplicatedGroup) -> None:
        super()._launch(g)
        while len(self.in_flight) > MAX_BUCKETS_IN_FLIGHT:
            self.in_flight.pop(0).wait()

    def stage_done(self, stage: int) -> None:
        """Move the pass's gradients into the pipeline stage's buckets and start their reduce-scatters."""
        for g in self.stage_buckets[stage]:
            g.wait()  # the previous micro-batch's reduce-scatter of this bucket
            g.take_grads()
            g.new_micro_batch()
            self._launch(g)

    def begin_micro_batch(self, last: bool) -> None:
        for g in self.in_flight:
            g.wait()
        self.in_flight = []
        super().begin_micro_batch(last)

    def finish(self) -> None:
        for g in self.deferred:  # full gradients kept until now (a tied embedding, already summed over pipeline stages)
            g.take_grads()
        super().finish()

    def state_bytes(self) -> dict[str, int]:
        peaks = {"grad_buffers_peak": self.buffers.peak} if self.buffers.measuring else {}
        return {"params": self.param_bytes(), "grads": held_bytes(g.grad_shard for g in self.groups), **peaks}

    def measure_buffers(self) -> None:
        self.buffers.measure()


class ZeroStage3(ZeroSync):
    """Parameters sharded too: each unit gathered just before its forward and backward and freed after."""

    def __init__(
        self, model: nn.Module, group: dist.ProcessGroup, policy: ZeroPolicy, *, units: list[UnitSpec], meter: CommMeter | None = None
    ) -> None:
        super().__init__(model, group, policy, meter)
        self.stage3 = Stage3(model, units, group, prefetch=policy.prefetch, compute_dtype=self.compute_dtype, meter=meter)
        self.groups = [u for u in self.stage3.units if not u.frozen]  # a frozen unit has no gradient, master or optimizer state

    def begin_micro_batch(self, last: bool) -> None:
        self.stage3.drain()

    def finish(self) -> None:
        self.stage3.finish()

    def param_bytes(self) -> int:
        return held_bytes(u.shard for u in self.stage3.units)

    def state_bytes(self) -> dict[str, int]:
        meters = self.stage3.gathered_bytes, self.stage3.grad_bytes
        peaks = {"gathered_peak": meters[0].peak, "grad_buffers_peak": meters[1].peak} if meters[0].measuring else {}
        return {**super().state_bytes(), **peaks}

    def measure_buffers(self) -> None:
        self.stage3.gathered_bytes.measure()
        self.stage3.grad_bytes.measure()


def apply_zero(
    model: nn.Module,
    group: dist.ProcessGroup,
    policy: ZeroPolicy,
    *,
    units: list[UnitSpec] | None = None,
    stage_params: dict[int, list[nn.Parameter]] | None = None,
    meter: CommMeter | None = None,
    select: Callable[[str], bool] | None = None,
) -> ZeroSync:
    """Shard `model`'s optimizer state (and gradients, and parameters) over `group` at ZeRO `policy.stage`.

    Stage 3 takes the units `shard_parameters` made before materialize (each over its own group: a mixture of
    experts' expert units over dp, the rest over dp x ep); under a pipeline stages 1-2 take `stage_params`, the
    parameters of each pipeline stage this rank holds (see the module docstring). At stages 1-2 `select` picks
    the parameters (by name) this sync keeps: a mixture of experts has one sync for dense and one for expert ones."""
    if tier_name(policy.optimizer_tier) not in (("device",) if policy.stage == 3 else ("device", "host")):
        raise BehemothError(
            f"ZeRO stage {policy.stage} with its optimizer state on the {policy.optimizer_tier} tier",
            "stages 1-2 keep it on the device or host tier; stage 3 offloads through offload/ (offload.optimizer=...)",
        )
    if policy.stage == 3:
        if units is None:
            raise ValueError("ZeRO stage 3 needs the units from shard_parameters(), called before materialize")
        if stage_params is not None:
            raise ValueError("ZeRO stage 3 gathers parameters per block, not per pipeline stage; use stage 1 or 2 with a pipeline")
        return ZeroStage3(model, group, policy, units=units, meter=meter)
    if policy.stage not in (1, 2):
        raise ValueError(f"apply_zero takes stage 1, 2 or 3, got {policy.stage}")
    cls = ZeroStage1 if policy.stage == 1 else ZeroStage2
    return cls(model, group, policy, stage_params=stage_params, meter=meter, select=select)


def shards_nothing(stage: int, param_dtype: str, optimizer_tier: str, data_ranks: int) -> bool:
    """Whether ZeRO-1/2 over `data_ranks` would shard nothing (one rank), with float32 parameters and the optimizer on
    the device: then its states are stage 0's, which keeps them for less (no per-micro-batch gradient copies or
    one-rank reduce-scatters: gpt-1m under pp = 2, 16 micro-batches, 94.5 ms a step against ZeRO-2's 122.5 here). The
    engine builds stage 0's sync for it (`parallelize.build_syncs`) and the planner prices it so (docs/performance.md)."""
    return stage in (1, 2) and param_dtype == "fp32" and optimizer_tier == "device" and data_ranks == 1
