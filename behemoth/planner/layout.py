"""A candidate plan as the planner prices it, and where its pipeline stages sit.

`Layout` holds what the search varies — the degrees (ep and cp with its attention included), the ZeRO stage, sequence parallelism, the micro-batch
size and count, the schedule and its chunks, the pipeline ranks that recompute, the stage boundaries and where the
model states live (`Offload`: the device, host memory or disk, per kind of state) — and
converts to and from the `ParallelPlan` a user writes (`to_plan`, `of_config`): the automatic planner emits
exactly the plan a user could have written by hand. `Workload` is what does not vary: the model's census, the
sequence length, the global batch and the precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from behemoth.offload.policy import OffloadPolicy
from behemoth.parallel.pipeline.refusals import V_SCHEDULES  # two model chunks per rank in a V: stages r and 2p-1-r
from behemoth.parallel.zero.runtime import shards_nothing
from behemoth.parallel.zero.tiers import TIER_NAMES
from behemoth.plan import ParallelPlan
from behemoth.planner.census import ModelCensus, TPShare

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1", "chimera", "zbv", "dualpipev", "1f1b-scp")
GRID_MODES = ("2d", "2.5d", "3d")  # tensor parallelism over a grid or a cube (behemoth/parallel/tensor/summa.py, cube.py)
CP_MODES = ("ring", "ulysses")  # context-parallel attention, resolved (parallel.cp_mode=auto picks one of them)


@dataclass(frozen=True)
class Workload:
    """The model, the batch and the precision a plan must serve (the same for every candidate)."""

    census: ModelCensus
    seq_len: int
    global_batch: int
    precision: str = "fp32"  # train.precision: bf16 autocast computes (and keeps activations) in bf16
    param_dtype: str = "fp32"  # parallel.param_dtype, the compute parameters under ZeRO 1-3
    bucket_mb: float = 25.0
    prefetch: int = 1
    capacity_factor: float | None = None  # model.moe.capacity_factor: slots per expert as a multiple of its even share
    dropout: float = 0.0  # model.dropout: materialized attention probabilities pass through a dropout kernel each way
    op_checkpointing: bool = False  # a selective op-level policy (torchtitan's "op"): every second product rerun in backward
    p2p_inline: str = "none"  # pipeline transfers a stage waits out in line with its passes: none, batched, separate (steptime.py)
    p2p_split: bool = False  # each tp rank sends 1/tp of a pipeline message, all-gathered within the tp group on arrival
    noisy_gating: bool = False  # model.moe.noise is not none: cp refuses it (each cp rank would draw other noise)
    loss_chunk: int = 0  # train.loss_chunk (0 too where a LoRA adapter on the head keeps it plain): the head's loss path

    @classmethod
    def of(cls, cfg: Any, census: ModelCensus | None = None) -> Workload:
        plan = cfg.parallel
        return cls(
            census or ModelCensus.of(cfg.model, cfg.hf, cfg.finetune.lora),
            cfg.seq_len,
            cfg.train.global_batch,
            cfg.train.precision,
            plan.param_dtype,
            plan.bucket_mb,
            plan.prefetch,
            cfg.model.moe.capacity_factor if cfg.model.moe.enabled else None,
            float(getattr(cfg.model, "dropout_p", 0.0) or 0.0),
            noisy_gating=cfg.model.moe.enabled and cfg.model.moe.noise != "none",
            loss_chunk=0 if head_adapted(cfg.finetune.lora) else cfg.train.loss_chunk,
        )

    @property
    def routed_rows(self) -> float:
        """Rows an MoE layer's all-to-all moves per token, each way: its top-k copies (dropless), or with a capacity the
        padded slots, capacity_factor x k (every rank sends G x C rows per expert, `AllToAllExperts.received_counts`)."""
        k = max(1, self.census.shape.top_k)
        return k * (self.capacity_factor if self.capacity_factor is not None else 1.0)

    @property
    def act_bytes(self) -> int:
        """Bytes of one saved activation element: 2 under bf16 autocast or with bf16 compute parameters, else 4."""
        return 2 if self.compute_dtype == "bf16" else 4

    @property
    def compute_dtype(self) -> str:
        return "bf16" if self.precision == "bf16" or self.param_dtype == "bf16" else "fp32"

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def share(self, lay: Layout) -> TPShare:
        """What one rank of `lay` holds of the model (its tp, 1-D or 2-D, and ep)."""
        return self.census.at(lay.tp, lay.ep, lay.tp_mode, lay.depth)


def head_adapted(lora: Any) -> bool:
    """Whether LoRA adapts the LM head (its hooks keep the head's plain linear + loss: CausalLM.chunked_head)."""
    return bool(lora.enabled) and any(t.split(".")[-1] == "lm_head" for t in lora.targets)


TIERS = TIER_NAMES  # offload.* tiers: device memory, host memory, disk


@dataclass(frozen=True)
class Offload:
    """Where a plan keeps each kind of model state (`offload.params/grads/optimizer`: device is device memory), the
    Adam moments' bits, the units read ahead and whether a unit steps during backward (then no gradient is stored);
    streamed unit by unit as ZeRO-3 units (offload/)."""

    params: str = "device"
    grads: str = "device"
    optimizer: str = "device"
    bits: int = 32
    prefetch: int = 2
    fused: bool = False
    zero_offload: bool = False  # ZeRO 1-2 with only the moments in host memory: priced as that stage, nothing streams
    io_threads: int = 2  # offload.io_threads: deferred steps that run at once (each holds a unit's moments)

    @classmethod
    def of(cls, cfg: Any) -> Offload:
        """The placement a config's `offload:` section states, as the runtime's policy resolves it (gradients on the
        parameters' tier when `auto`; the fused step when unclipped)."""
        if not cfg.offload.enabled:
            return cls()
        p = OffloadPolicy.of(cfg.offload, run_dir=cfg.run.dir, grad_clip=cfg.train.grad_clip)
        return cls(p.params, p.grads, p.optimizer, p.bits, p.prefetch, p.fused, zero_offload=not cfg.offload_streams, io_threads=p.io_threads)

    @property
    def enabled(self) -> bool:
        """Some state off the device (its bytes counted on their tier, their traffic priced)."""
        return any(t != "device" for t in (self.params, self.grads, self.optimizer)) or self.bits == 8

    @property
    def streams(self) -> bool:
        """Whether the units stream through offload's runtime (ZeRO-3's units on their tiers)."""
        return self.enabled and not self.zero_offload

    def tier(self, kind: str) -> str:
        """The tier of `kind` (params, grads or optimizer)."""
        return getattr(self, kind)

    def describe(self) -> str:
        """`off[p=disk g=disk o=host 8bit]`: the placement in one short word (empty when every state is on the device)."""
        if not self.enabled:
            return ""
        tiers = " ".join(f"{k[0]}={self.tier(k)}" for k in ("params", "grads", "optimizer") if self.tier(k) != "device")
        return f"off[{tiers}{' 8bit' if self.bits == 8 else ''}]".replace("[ ", "[")

    def to_config(self, base: Any) -> dict[str, Any]:
        """The `offload:` fields a user would write for this placement (others kept from `base`, a config section)."""
        return {
            **base.model_dump(),
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "optimizer_bits": self.bits,
            "prefetch": self.prefetch,
        }


@dataclass(frozen=True)
class Layout:
    """One plan: degrees, ZeRO, SP, batch split, schedule, recompute, stage boundaries, experts and offload."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    sp: bool = False
    micro_batch: int = 1  # sequences per micro-batch
    microbatches: int = 1  # micro-batches per step and data rank (dp x ep; accumulation, or the pipeline's m)
    schedule: str = "1f1b"
    chunks: int = 1  # model chunks per rank: v of the interleaved schedule, else 1
    recompute: tuple[int, ...] = ()  # pipeline ranks that recompute every block (0 alone without a pipeline)
    boundaries: tuple[int, ...] | None = None  # first block of every model stage, then n_layer (None: the planner balances)
    ep: int = 1  # expert parallelism: each rank holds 1/ep of every MoE layer's experts
    offload: Offload = Offload()  # where the model states live
    cp: int = 1  # context parallelism: each rank holds 1/cp of every sequence's tokens
    cp_mode: str = "ring"  # ring or ulysses (what parallel.cp_mode resolves to; unused at cp=1)
    tp_mode: str = "1d"  # 1d (Megatron's column/row split), 2d (a q x q SUMMA grid, tp = q*q: docs/tensor2d.md),
    # 2.5d (Tesseract: tp_depth such grids, tp = d*q*q) or 3d (a q x q x q cube, tp = q^3)
    tp_depth: int = 1  # parallel.tp_depth: the grids of a 2.5-D Tesseract (1 otherwise)

    @property
    def gridded(self) -> bool:
        """Whether tensor parallelism is a grid or a cube (2d, 2.5d, 3d): every activation and parameter in pieces."""
        return self.tp_mode in GRID_MODES and self.tp > 1

    @property
    def seq_split(self) -> bool:
        """Whether activations outside the tensor-parallel region are split over tp too: sequence parallelism, or a grid
        or cube (1/tp of every activation: 1/q^2 on a 2-D grid, 1/(q^2 d) under 2.5-D, 1/q^3 on a cube)."""
        return self.sp or self.gridded

    @property
    def grid(self) -> int:
        """q, the side of a 2-D / 2.5-D grid or of a 3-D cube (1 under 1-D tensor parallelism)."""
        if not self.gridded:
            return 1
        if self.tp_mode == "3d":
            return round(self.tp ** (1 / 3))
        return math.isqrt(self.tp // self.depth)

    @property
    def depth(self) -> int:
        """d of a 2.5-D Tesseract (1 in every other mode)."""
        return self.tp_depth if self.tp_mode == "2.5d" else 1

    @property
    def param_split(self) -> int:
        """Pieces each weight matrix is cut into over the tp group: tp, but q^2 under 2.5-D (the d grids hold the same
        pieces, Tesseract's 1/q^2)."""
        return self.grid**2 if self.tp_mode == "2.5d" and self.tp > 1 else self.tp

    @property
    def regathers_units(self) -> bool:
        """Whether ZeRO-3 gathers a unit again in backward (it does so for a parameter autograd saved): not on a cube,
        whose linears save their weight blocks gathered along T and whose norms and tables save their plane gathers."""
        return not (self.tp_mode == "3d" and self.tp > 1)

    @property
    def batch_blocks(self) -> int:
        """Parts a micro-batch's sequences are cut into over the tp group: q grid rows (2d), d x q (2.5d), q^2 (3d)."""
        if not self.gridded:
            return 1
        return self.grid**2 if self.tp_mode == "3d" else self.grid * self.depth

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.ep * self.tp * self.pp

    @property
    def shard_ranks(self) -> int:
        """Ranks that hold the same dense parameters and see different tokens, over which their gradients are summed and
        ZeRO shards them: dp x cp x ep (`Runtime.data_group`)."""
        return self.dp * self.cp * self.ep

    def tokens(self, seq_len: int) -> int:
        """Tokens of one micro-batch on one rank: its sequences' share of 1/cp."""
        return self.micro_batch * seq_len // self.cp

    @property
    def data_ranks(self) -> int:
        """Ranks that see different tokens, over which dense parameters are synchronised: dp x ep."""
        return self.dp * self.ep

    @property
    def stages(self) -> int:
        """Model stages: pp, times the chunks of the interleaved schedule."""
        return self.pp * self.chunks

    def held_stages(self, rank: int) -> tuple[int, ...]:
        """The model stages pipeline rank `rank` holds (Chimera: its down and up stage; interleaved: r, r+p, ...)."""
        if self.pp == 1:
            return (0,)
        if self.schedule == "chimera":
            return tuple(sorted({rank, self.pp - 1 - rank}))
        if self.schedule in V_SCHEDULES:
            return (rank, 2 * self.pp - 1 - rank)
        return tuple(rank + c * self.pp for c in range(self.chunks))

    def describe(self) -> str:
        """`dp=2 tp=2 pp=4 zero=1 sp 1f1b mb=2x8 rc[0,1]`: the plan in one short line."""
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}", f"zero={self.zero}"]
        if self.ep > 1:
            parts.insert(1, f"ep={self.ep}")
        if self.cp > 1:
            parts.insert(1, f"cp={self.cp}({self.cp_mode})")
        if self.sp:
            parts.append("sp")
        if self.gridded:
            q = self.grid
            parts.append({"2d": f"2d[{q}x{q}]", "2.5d": f"2.5d[{self.depth}x{q}x{q}]", "3d": f"3d[{q}x{q}x{q}]"}[self.tp_mode])
        if self.pp > 1:
            parts.append(self.schedule + (f"x{self.chunks}" if self.chunks > 1 and self.schedule == "interleaved" else ""))
        parts.append(f"mb={self.micro_batch}x{self.microbatches}")
        if self.recompute:
            parts.append("rc" + ("all" if len(self.recompute) == self.pp else str(list(self.recompute))))
        if self.offload.enabled:
            parts.append(self.offload.describe())
        return " ".join(parts)

    def to_plan(self, base: ParallelPlan | None = None) -> ParallelPlan:
        """The `parallel:` section a user would write for this layout (options outside the layout kept from `base`)."""
        fields = (base or ParallelPlan()).model_dump()
        recompute: Any = "none"
        if self.recompute:
            recompute = "full" if len(self.recompute) == self.pp else list(self.recompute)
        fields.update(
            dp=self.dp,
            ep=self.ep,
            cp=self.cp,
            cp_mode=self.cp_mode if self.cp > 1 else (base or ParallelPlan()).cp_mode,
            tp=self.tp,
            tp_mode=self.tp_mode,
            tp_depth=self.depth,
            pp=self.pp,
            zero_stage=self.zero,
            sequence_parallel=self.sp and self.tp > 1,
            microbatches=self.microbatches,
            schedule=self.schedule,
            recompute=recompute,
            stage_boundaries=list(self.boundaries) if self.boundaries and self.pp > 1 else None,
            memory_gb=None,
            balance="flops",
        )
        if self.schedule == "interleaved":
            fields["chunks"] = self.chunks
        if self.zero == 0:
            fields["param_dtype"] = "fp32"
        return ParallelPlan.model_validate(fields)

    @classmethod
    def of_config(cls, cfg: Any, world: int) -> Layout:
        """The layout a config's plan (and offload section) describes on `world` processes (its recompute policy resolved
        to ranks)."""
        from behemoth.models.causal_lm import model_shape
        from behemoth.parallel.context.apply import heads_per_rank, resolve_mode
        from behemoth.parallel.pipeline.analysis.simulate import peak_stash
        from behemoth.parallel.pipeline.schedules import build_schedule
        from behemoth.parallel.recompute import recompute_ranks

        plan = cfg.parallel
        dims = plan.dims(world)
        batch = cfg.batch_layout(dims)
        v = plan.schedule_chunks
        stash = peak_stash(build_schedule(plan.schedule, plan.pp, batch.accum, v)) if plan.pp > 1 else (1,)
        ranks = tuple(sorted(recompute_ranks(plan.recompute, stash)))
        bounds = tuple(plan.stage_boundaries) if plan.stage_boundaries is not None else None
        return cls(
            dims.dp,
            dims.tp,
            dims.pp,
            plan.zero_stage,
            plan.sequence_parallel and dims.tp > 1,
            batch.micro_batch,
            batch.accum,
            plan.schedule,
            v,
            ranks,
            bounds,
            dims.ep,
            Offload.of(cfg),
            dims.cp,
            resolve_mode(plan.cp_mode, heads_per_rank(model_shape(cfg.model, cfg.hf).n_head, dims.tp, plan.tp_mode, plan.tp_depth), dims.cp)
            if dims.cp > 1
            else "ring",
            plan.tp_mode if dims.tp > 1 else "1d",
            plan.tp_depth if plan.tp_mode == "2.5d" and dims.tp > 1 else 1,
        )

    def but(self, **changes: Any) -> Layout:
        return replace(self, **changes)


def as_run(work: Workload, lay: Layout) -> Layout:
    """`lay` as the engine runs it: ZeRO-1/2 over a data-parallel group of one rank, with float32 parameters and the
    optimizer on the device, is stage 0 (`zero.shards_nothing`)."""
    return lay.but(zero=0) if shards_nothing(lay.zero, work.param_dtype, lay.offload.tier("optimizer"), lay.shard_ranks) else lay
