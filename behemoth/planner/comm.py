"""What a step's collectives outside a block's 1-D tensor parallelism cost: a grid's or cube's tensor-parallel
collectives, the data-parallel gradient reduction (and ZeRO's all-gathers) less what the runtime overlaps with the
passes, expert parallelism's all-to-alls, and the two synchronizations that run once per step (2.5-D's depth
all-reduce, Chimera's replica all-reduce). Every collective is priced by the alpha-beta model of the link its group
spans (`cluster.ClusterSpec.collective`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from behemoth.planner.cluster import ClusterSpec
from behemoth.planner.footprint import STATE_BYTES_ZERO0
from behemoth.planner.layout import Layout, Workload
from behemoth.planner.memory import BYTES_PER_PARAM


def grid_seconds(work: Workload, lay: Layout, cluster: ClusterSpec, x: float, w: float, y: float) -> float:
    """Seconds of one linear's tensor-parallel collectives in forward and backward for a whole layer's input `x`, weight
    `w` and output `y` (elements): SUMMA's on a 2-D / 2.5-D grid (`summa_seconds`), the cube's on a 3-D one."""
    return cube_seconds(work, lay, cluster, x, w, y) if lay.tp_mode == "3d" else summa_seconds(work, lay, cluster, x, w)


def summa_seconds(work: Workload, lay: Layout, cluster: ClusterSpec, x: float, w: float) -> float:
    """Seconds of one SUMMA linear's collectives in forward and backward on a q x q grid, for a whole layer's
    activation `x` and weight `w` (elements): 3q steps (q broadcasts forward; q broadcasts and q reductions backward),
    each moving a block of both, 1/q^2 of them (`summa.summa_volume`: 3q (x + w) / q^2 elements per rank), on the
    link the grid spans, each step its own latency. Under 2.5-D each of the d grids runs it on its 1/d of the tokens
    (Tesseract: activation blocks x / (d q^2), the same weight blocks w / q^2)."""
    q = lay.grid
    step = cluster.collective("p2p", (x / lay.depth + w) / q**2 * work.act_bytes, lay.tp) + cluster.messages_cpu("p2p", q)
    return 3 * q * step


def cube_seconds(work: Workload, lay: Layout, cluster: ClusterSpec, x: float, w: float, y: float) -> float:
    """Seconds of one 3-D linear's six collectives over lines of q ranks (`cube.cube_volume`): forward all-gathers X
    along O and W along T and reduce-scatters Y along I; backward all-gathers dY and reduce-scatters dX and dW; each
    gathered (scattered) tensor q times the rank's 1/q^3 piece, priced by the alpha-beta model on the cube's link."""
    q = lay.grid

    def line(op: str, whole: float) -> float:
        return cluster.collective(op, whole / q**2 * work.act_bytes, q) + cluster.messages_cpu(op, q)

    forward = line("all_gather", x) + line("all_gather", w) + line("reduce_scatter", y)
    return forward + line("all_gather", y) + line("reduce_scatter", x) + line("reduce_scatter", w)


def depth_sync_seconds(work: Workload, lay: Layout, cluster: ClusterSpec, elements: float) -> float:
    """2.5-D: the all-reduce of every weight gradient over the d grids that hold the same pieces, once per step after
    the passes (`TensorParallel2D.finish_grads`), on the tp group's link (ranks q^2 apart)."""
    if lay.tp_mode != "2.5d" or lay.depth == 1 or lay.tp == 1:
        return 0.0
    return cluster.collective("all_reduce", bytes_per(lay, work)[1] * elements, lay.depth, lay.grid**2)


def bytes_per(lay: Layout, work: Workload) -> tuple[int, int]:
    """(parameter, gradient) bytes of the compute copies the data-parallel traffic moves."""
    p, g, _ = STATE_BYTES_ZERO0 if lay.zero == 0 else BYTES_PER_PARAM[work.param_dtype]
    return p, g


@dataclass(frozen=True)
class DataParallelTime:
    """A step's data-parallel / ZeRO collectives: their seconds on the link (`traffic`) and what computation does not
    hide (`exposed`): collectives run on their own stream beside the passes, up to `comm_overlap` of the compute they
    can run behind; the first gather of a pass and the last reduction after backward are always exposed; while one
    runs beside the passes they lose `overlap_slowdown` of their rate (`contention`, included in `exposed`)."""

    traffic: float
    exposed: float
    contention: float = 0.0
    cpu: float = 0.0  # of `exposed`: the CPU its messages cost a CPU process between computations (`ClusterSpec.messages_cpu`)


def behind(cluster: ClusterSpec, comm: float, compute: float, first: float) -> tuple[float, float]:
    """(exposed, contention) seconds of `comm` seconds of collectives beside `compute` seconds of passes, of which
    `first` cannot start before the passes need it (or after they end): what the compute's `comm_overlap` share does
    not cover runs alone; what it covers slows the compute by `overlap_slowdown` of its own length."""
    dev = cluster.device
    hidden = min(max(comm - first, 0.0), dev.comm_overlap * compute)
    contention = dev.overlap_slowdown * hidden
    return comm - hidden + contention, contention


def bucket_seconds(cluster: ClusterSpec, op: str, nbytes: float, bucket: float, ranks: int, stride: int) -> tuple[float, float]:
    """(all buckets, the last bucket) seconds of `op` over `nbytes` sent in buckets of `bucket` bytes."""
    if nbytes <= 0:
        return 0.0, 0.0
    full, rest = divmod(nbytes, bucket)
    each = cluster.collective(op, bucket, ranks, stride)
    last = cluster.collective(op, rest, ranks, stride) if rest else each
    return full * each + (last if rest else 0.0), last


def data_parallel_time(work: Workload, lay: Layout, cluster: ClusterSpec, elements: float, forward: float, backward: float) -> DataParallelTime:
    """The data-parallel traffic of `elements` parameters on the group's link (dp x ep ranks, tp apart): DDP's bucketed
    all-reduce behind the last micro-batch's `backward`; ZeRO 1-2's bucketed reduce-scatter (every micro-batch under
    ZeRO-2) and the parameters' all-gather after the step; ZeRO-3's per-unit all-gathers in forward and backward (a
    cube's in forward only) and reduce-scatters in backward, every micro-batch, each behind one unit's share of `forward` and `backward` (the
    runtime prefetches one unit ahead: a unit's collectives hide behind its neighbour's compute, not the pass's).
    A pipeline reduces once, after its passes (nothing hides it)."""
    n = lay.shard_ranks
    if n == 1:
        return DataParallelTime(0.0, 0.0)
    p, g = bytes_per(lay, work)
    if lay.pp > 1:
        forward = backward = 0.0
    bucket, tp, m = work.bucket_mb * 2**20, lay.tp, lay.microbatches
    if lay.zero == 0:
        traffic, last = bucket_seconds(cluster, "all_reduce", g * elements, bucket, n, tp)
        exposed, contention = behind(cluster, traffic, backward, last)
        cpu = cluster.messages_cpu("all_reduce", n, math.ceil(g * elements / bucket))
        return DataParallelTime(traffic, exposed + cpu, contention, cpu)
    if lay.zero in (1, 2):
        scatter, last = bucket_seconds(cluster, "reduce_scatter", g * elements, bucket, n, tp)
        gather = cluster.collective("all_gather", p * elements, n, tp)
        syncs = m if lay.zero == 2 and lay.pp == 1 else 1
        exposed, contention = behind(cluster, scatter, backward, last)
        cpu = cluster.messages_cpu("reduce_scatter", n, syncs * math.ceil(g * elements / bucket)) + cluster.messages_cpu("all_gather", n)
        return DataParallelTime(syncs * scatter + gather, syncs * exposed + gather + cpu, syncs * contention, cpu)
    units = max(1, work.census.shape.n_layer // lay.pp)
    gather = cluster.collective("all_gather", p * elements / units, n, tp)
    scatter = cluster.collective("reduce_scatter", g * elements / units, n, tp)
    # forward: the first unit's gather waits; each later one hides behind the unit before it
    f_rest, f_slow = behind(cluster, gather, forward / units, 0.0)
    # backward: each unit's next gather (none on a cube: `Layout.regathers_units`) and its own reduce-scatter share the
    # collective stream behind its backward
    again = gather if lay.regathers_units else 0.0
    b_rest, b_slow = behind(cluster, again + scatter, backward / units, 0.0)
    exposed_f = gather + (units - 1) * f_rest
    exposed_b = (units - 1) * b_rest + max(scatter, b_rest)
    contention = (units - 1) * (f_slow + b_slow)
    gathers = 2 if lay.regathers_units else 1
    cpu = cluster.messages_cpu("all_gather", n, m * units * gathers) + cluster.messages_cpu("reduce_scatter", n, m * units)
    return DataParallelTime(m * units * (gather + again + scatter), m * (exposed_f + exposed_b) + cpu, m * contention, cpu)


def data_parallel_seconds(work: Workload, lay: Layout, cluster: ClusterSpec, elements: float, backward: float, forward: float | None = None) -> float:
    """Exposed seconds of `data_parallel_time` (forward defaults to half the backward, its FLOP share)."""
    return data_parallel_time(work, lay, cluster, elements, backward / 2 if forward is None else forward, backward).exposed


def chimera_sync_seconds(lay: Layout, cluster: ClusterSpec, elements: float) -> float:
    """Chimera's all-reduce of every stage's gradients between its two replicas (on the pipeline's link)."""
    if lay.schedule != "chimera" or lay.pp == 1:
        return 0.0
    return cluster.link(lay.world).seconds("all_reduce", 4 * elements, 2)


def expert_seconds(work: Workload, lay: Layout, cluster: ClusterSpec) -> float:
    """Expert parallelism's all-to-alls in a step: per MoE block a rank holds and micro-batch, its tokens' hidden states
    to the k experts they visit and back, in forward and again in backward, over ep ranks (a group tp ranks apart)."""
    shape = work.census.shape
    if lay.ep == 1 or not shape.experts:
        return 0.0
    moe_blocks = sum(1 for e in shape.experts if e) / lay.pp
    routed = lay.tokens(work.seq_len) * shape.d_model * work.routed_rows * work.act_bytes  # capacity-padded slots
    a2a = cluster.collective("all_to_all", routed, lay.ep, lay.tp) + cluster.messages_cpu("all_to_all", lay.ep)
    return 4 * lay.microbatches * moe_blocks * a2a
