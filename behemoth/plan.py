"""ParallelPlan: the contract between the planner and the executor.

A plan is a plain, serializable value. A user can write one by hand in the `parallel:` section of a
config; the automatic planner will emit the same object. Each field is checked on its own here; whether
a plan can run a given model on a given world (degrees, divisibility, combinations, memory) is the
question `planner/feasibility.problems` answers, with every reason at once.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from behemoth.errors import BehemothError, Problem, collect
from behemoth.topology import ParallelDims, resolve_dims


class ParallelPlan(BaseModel):
    """How one training job is laid out over processes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dp: int | None = Field(None, ge=1, description="data-parallel degree (default: every process)")
    bucket_mb: float = Field(25.0, description="gradient bucket size in MiB (all-reduce, or reduce-scatter under ZeRO 1-2)")
    pp: int = Field(1, ge=1, description="pipeline-parallel degree: ranks in one pipeline")
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1", "chimera", "zbv", "dualpipev", "1f1b-scp"] = Field(
        "1f1b", description="pipeline schedule (pp > 1); zbv and dualpipev hold 2 chunks per rank in a V; 1f1b-scp recomputes"
    )
    microbatches: int | None = Field(
        None, ge=1, description="micro-batches per step per pipeline (default: train.micro_batch, else under pp > 1 about 4 x pp)"
    )
    chunks: int = Field(2, ge=2, description="model chunks per rank for the interleaved schedule")
    stage_boundaries: list[int] | None = Field(None, description="first block of every stage, then n_layer, e.g. [0,3,8] (default: balanced)")
    balance: Literal["flops", "time", "layers"] = Field("flops", description="what stages balance when stage_boundaries is unset")
    recompute: Literal["none", "full", "early"] | list[int] = Field(
        "none", description="activation recomputation: none, full, early (stage-aware: ranks that stash most), or pipeline ranks"
    )
    tp: int = Field(1, ge=1, description="tensor-parallel degree (the total: q x q ranks under tp_mode=2d), innermost mesh dimension")
    tp_mode: Literal["1d", "2d", "2.5d", "3d"] = Field(
        "1d",
        description="tensor-parallel style: 1d (Megatron: column/row-parallel), 2d (SUMMA over a q x q grid, tp = q*q), "
        "2.5d (Tesseract: tp_depth such grids, tp = d*q*q), 3d (all-gather / reduce-scatter over a q x q x q cube, "
        "tp = q*q*q; docs/tensor2d.md)",
    )
    tp_depth: int = Field(1, ge=1, description="tp_mode=2.5d: grids (layers) of the Tesseract, each holding 1/d of the batch")
    tp_subbatches: Literal[1, 2, 4] = Field(
        1,
        description="sub-pipelined TP (tp_mode=1d): blocks run each micro-batch as 2 or 4 sub-batches, one's all-reduce under the next's compute",
    )
    tp_regather: bool = Field(
        False, description="tp_mode=3d: linears save their 1/q^3 input and weight pieces and gather them again in backward (1/q^3 activations)"
    )
    sequence_parallel: bool = Field(False, description="norms and dropout on 1/tp of the sequence (reduce-scatter + all-gather; no effect at tp=1)")
    zero_stage: int = Field(0, description="ZeRO: 0 replicate, 1 shard optimizer state, 2 and gradients, 3 and parameters")
    prefetch: int = Field(1, ge=0, description="ZeRO-3: blocks whose all-gather is issued ahead of use")
    param_dtype: Literal["fp32", "bf16"] = Field("fp32", description="ZeRO 1-3 compute params/grads; bf16 keeps fp32 master + Adam state")
    memory_gb: float | None = Field(None, gt=0, description="GiB per rank for model states; refuse a plan the estimate says won't fit")
    cp: int = Field(1, ge=1, description="context-parallel degree: ranks that share one sequence, each holding 1/cp of its tokens")
    cp_mode: Literal["ring", "ulysses", "auto"] = Field(
        "auto", description="context-parallel attention: ring (K/V around the ranks), ulysses (all-to-all to heads), auto: ulysses when heads split"
    )
    # mixture of experts (model.moe): experts over ep ranks, the batch over dp x ep
    ep: int = Field(1, ge=1, description="expert-parallel degree: each rank holds 1/ep of every MoE layer's experts")
    expert_layout: Literal["alltoall", "gather"] = Field("alltoall", description="tokens to the experts, or the experts to the tokens")
    expert_chunks: int = Field(1, ge=1, description="all-to-all pipelining degree: expert compute overlaps the next chunk's transfer")
    expert_adapt: Literal["off", "probe", "cost"] = Field("off", description="switch expert layouts at run time: measured probe or cost model")
    expert_probe_every: int = Field(50, ge=1, description="steps between probes (expert_adapt=probe) or cost-model choices (cost)")
    expert_node_size: int | None = Field(
        None, ge=1, description="ranks per node: an ep group spanning nodes all-to-alls in two levels (default: torchrun's LOCAL_WORLD_SIZE)"
    )
    expert_a2a: Literal["auto", "flat", "2dh"] = Field(
        "auto", description="expert all-to-all: 2dh (two levels, one message per node), flat (one per rank), auto: 2dh when ep spans nodes"
    )
    burst: list[int] | None = Field(
        None, description="burst plan (DeepPool): a data-parallel width per layer (embedding, each block, head); from behemoth plan --burst --out"
    )

    @field_validator("zero_stage")
    @classmethod
    def _check_zero_stage(cls, v: int) -> int:
        if v not in (0, 1, 2, 3):
            raise ValueError("ZeRO stages are 0 (replicated), 1 (shard optimizer state), 2 (and gradients) and 3 (and parameters); choose one")
        return v

    @field_validator("bucket_mb")
    @classmethod
    def _check_bucket(cls, v: float) -> float:
        if not v > 0:
            raise ValueError("a gradient bucket must hold more than 0 MiB; use e.g. parallel.bucket_mb=25")
        return v

    @property
    def num_stages(self) -> int:
        """Model stages: pp, or pp x chunks for the interleaved schedule."""
        return self.pp * self.schedule_chunks

    @property
    def schedule_chunks(self) -> int:
        """Model chunks per rank as the schedule counts them (v): chunks for interleaved, 2 for the V schedules, else 1."""
        if self.pp > 1 and self.schedule in ("zbv", "dualpipev"):
            return 2
        return self.chunks if self.pp > 1 and self.schedule == "interleaved" else 1

    def micro_batch(self, global_batch: int, micro_batch: int | None, dp: int) -> int | None:
        """Sequences per micro-batch: fixed by `microbatches` (per step and data-parallel rank) when set, else train.micro_batch;
        a pipeline with neither fills itself (`default_microbatches`)."""
        if self.microbatches is None:
            if micro_batch is None and self.pp > 1 and global_batch % dp == 0:
                return global_batch // dp // self.default_microbatches(global_batch // dp)
            return micro_batch
        if global_batch % (dp * self.microbatches):
            raise BehemothError(
                f"train.global_batch={global_batch} does not split into dp={dp} x parallel.microbatches={self.microbatches}",
                f"use a global_batch that is a multiple of {dp * self.microbatches}",
            )
        size = global_batch // (dp * self.microbatches)
        if micro_batch is not None and micro_batch != size:
            raise BehemothError(
                f"train.micro_batch={micro_batch} contradicts parallel.microbatches={self.microbatches} "
                f"(global_batch {global_batch} / dp {dp} / {self.microbatches} = {size} sequences)",
                "set only one of them",
            )
        return size

    def default_microbatches(self, sequences: int) -> int:
        """Micro-batches for a pipeline given `sequences` per data-parallel rank and no micro-batch setting: the fewest
        multiples of pp that divide them and are at least 4 x pp, else the fewest divisors that are, else the most that
        divide them. 1F1B's bubble (p-1)/(m+p-1) is then at most 1/5 (11% at p=2); interleaved and Chimera need
        multiples of pp, DualPipeV at least 2 x pp."""
        divisors = [m for m in range(1, sequences + 1) if sequences % m == 0]
        whole = [m for m in divisors if m % self.pp == 0]
        enough = [m for m in whole if m >= 4 * self.pp] or [m for m in divisors if m >= 4 * self.pp]
        return enough[0] if enough else (whole or divisors)[-1]

    def degrees(self) -> dict[str, int | None]:
        """The mesh degrees this plan sets, for init_runtime."""
        return {"pp": self.pp, "dp": self.dp, "ep": self.ep, "tp": self.tp, "cp": self.cp}

    def dims(self, world_size: int) -> ParallelDims:
        """The mesh degrees this plan asks for on `world_size` processes (validated)."""
        return resolve_dims(world_size, **self.degrees())

    def dims_problems(self, world_size: int) -> list[Problem]:
        """Why this plan's degrees do not fit `world_size` processes (empty when they do)."""
        if world_size < 1:
            return [Problem.of("--nproc", f"--nproc {world_size} is not a process count", "use --nproc 1 or more")]
        return collect("parallel", self.dims, world_size)

    def combination_problems(self, *, streamed: bool = False) -> list[Problem]:
        """Settings that cannot go together, whatever the model and world (`streamed`: offload streams ZeRO-3's units,
        whose float32 masters it keeps, at any zero_stage)."""
        out = []
        if self.param_dtype != "fp32" and self.zero_stage == 0 and not streamed:
            out.append(
                Problem.of(
                    "parallel.param_dtype",
                    f"parallel.param_dtype={self.param_dtype} needs float32 master weights, which ZeRO (or offload) keeps",
                    "set parallel.zero_stage=1, 2 or 3, or offload the states (offload.params=...), or use train.precision=bf16 autocast",
                )
            )
        if self.zero_stage == 3 and self.pp > 1 and not streamed:  # streamed, each stage gathers its units per pass by design
            out.append(
                Problem.of(
                    "parallel.zero_stage",
                    f"parallel.zero_stage=3 with pp={self.pp}: ZeRO-3 would gather every stage's parameters again for each of the schedule's passes",
                    "use parallel.zero_stage=1 or 2 with a pipeline",
                )
            )
        if self.zero_stage == 2 and self.pp > 1 and self.schedule == "chimera":
            out.append(
                Problem.of(
                    "parallel.zero_stage",
                    "parallel.zero_stage=2 with parallel.schedule=chimera: Chimera sums each stage's "
                    "full gradient between its two replicas, which ZeRO-2 does not keep",
                    "use parallel.zero_stage=1",
                )
            )
        return out

    def tensor_parallel_problems(self, sizes: dict[str, int], seq_len: int) -> list[Problem]:
        """Sizes (by the option that sets them) that tp does not split: heads, KV heads, widths; the sequence under SP."""
        t = self.tp
        if self.tp_mode != "1d":  # its own sizes (parallel/tensor/twod_problems.py)
            return []
        sizes = dict(sizes)
        if self.sequence_parallel:
            sizes["sequence length (train.seq_len)"] = seq_len
        bad = [f"{name}={value}" for name, value in sizes.items() if value % t]
        if not bad:
            return []
        return [
            Problem.of(
                "parallel.tp",
                f"parallel.tp={t} does not divide {', '.join(bad)}",
                f"choose a tp that divides each of them (e.g. tp={math.gcd(*sizes.values())} or a divisor of it)",
            )
        ]
