"""Time of one training step under a plan, from FLOPs, the cluster's rates and its links.

Each pass of a micro-batch through a stage costs its matrix FLOPs at the device's rate for matrices of that size,
plus its elementwise traffic at the memory bandwidth, plus a fixed launch cost per operator; tensor parallelism adds
its collectives inside the passes (two all-reduces per block each way, or with sequence parallelism two all-gathers
and two reduce-scatters of the same bytes), on the link the tensor-parallel group spans. The pipeline turns per-stage
forward, backward and weight-gradient costs into a step: a closed form while searching, the schedule simulator
(`simulate.py`) for the plans that are reported. Data parallelism adds the gradient reduction (and ZeRO's
all-gathers) on its link, less what the runtime overlaps with backward; the optimizer step is memory-bound. Expert
parallelism adds each MoE block's all-to-alls (tokens to their experts and back, both ways) on the link its group
spans; offload adds the bytes its tiers move per step (host memory or disk, shared by a node's devices), of which
what the passes do not hide (the streamer reads ahead while they compute) is exposed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from behemoth.models.shape import LayerCosts, block_forward_flops
from behemoth.parallel.pipeline.analysis.simulate import Costs, simulate
from behemoth.parallel.pipeline.partition import balance_stages
from behemoth.parallel.pipeline.schedules import build_schedule
from behemoth.planner.cluster import ClusterSpec
from behemoth.planner.footprint import STATE_BYTES_ZERO0, placed, rank_elements, state_bytes
from behemoth.planner.layout import Layout, Workload
from behemoth.planner.memory import BYTES_PER_PARAM

FORWARD_OPS_PER_BLOCK = 30  # operators one block's forward launches (norms, matrices, attention, activation, adds)
HEAD_OPS = 12  # final norm, head, loss
OPTIMIZER_BYTES_PER_ELEMENT = 36  # AdamW reads parameter, gradient and two moments, writes three, plus temporaries
ELEMENTWISE_PASSES = 2.0  # each saved activation element is written once and read about once more in forward


@dataclass(frozen=True)
class PassCosts:
    """Seconds of one micro-batch's passes through each model stage, and of the pipeline's messages."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]  # input-gradient pass (a full backward is backward + weight)
    weight: tuple[float, ...]
    p2p: float
    tp_comm: float  # of all passes of one micro-batch through the whole model, included above
    recompute: float  # of all passes of one micro-batch, included above


@dataclass
class StepTime:
    """A step's seconds by part; `total` is what the plan is ranked by."""

    passes: float  # the micro-batches' passes (the pipeline's step, bubble included)
    bubble: float  # idle share of the pipeline, in seconds
    tp_comm: float
    pp_comm: float  # the pipeline messages' latency, summed (what they make ranks wait is part of the bubble)
    dp_comm: float  # exposed data-parallel / ZeRO traffic
    optimizer: float
    recompute: float
    simulated: bool = False
    ep_comm: float = 0.0  # expert parallelism's all-to-alls (not overlapped)
    offload_io: float = 0.0  # seconds the offload tiers move bytes in a step, of which `offload` is exposed

    @property
    def offload(self) -> float:
        return max(self.offload_io - self.passes, 0.0)

    @property
    def total(self) -> float:
        return self.passes + self.dp_comm + self.optimizer + self.ep_comm + self.offload


def uniform_bounds(embed: float, block: float, head: float, n: int, stages: int) -> tuple[int, ...]:
    """Fence posts for `n` equal blocks in `stages` stages (embedding cost on the first, head on the last) that
    minimize the costliest stage, then even out the rest: `balance_stages`'s optimum, found by bisecting the costliest
    stage's cost instead of a dynamic program over every cut (equal blocks make the caps a closed form)."""
    if stages == 1:
        return (0, n)
    extras = [embed] + [0.0] * (stages - 2) + [head]

    def caps(limit: float) -> list[int]:
        return [int((limit - e) / block + 1e-9) for e in extras]

    lo, hi = 0.0, max(extras) + n * block
    while hi - lo > 1e-9 * hi:
        mid = (lo + hi) / 2
        c = caps(mid)
        lo, hi = (lo, mid) if min(c) >= 1 and sum(c) >= n else (mid, hi)
    take = caps(hi)
    while sum(take) > n:
        cost = [t * block + e for t, e in zip(take, extras)]
        i = max((j for j in range(stages) if take[j] > 1), key=lambda j: (cost[j], j))
        take[i] -= 1
    bounds = [0]
    for t in take:
        bounds.append(bounds[-1] + t)
    return tuple(bounds)


@lru_cache(maxsize=256)
def runtime_bounds(costs: LayerCosts, stages: int) -> tuple[int, ...]:
    """The boundaries the runtime chooses for an unset `stage_boundaries` (balance=flops)."""
    return tuple(balance_stages(costs, stages))


def matmul_size(work: Workload, lay: Layout) -> float:
    """Typical dimension of a block's matrix products: the geometric mean of tokens x width x MLP width / t."""
    shape = work.census.shape
    return (lay.micro_batch * work.seq_len * shape.d_model * shape.ffn / lay.tp) ** (1 / 3)


def block_pass(work: Workload, lay: Layout, cluster: ClusterSpec) -> tuple[float, float]:
    """(compute, tp communication) seconds of one block's forward for one micro-batch on one rank."""
    dev, tokens = cluster.device, lay.micro_batch * work.seq_len
    flops = block_forward_flops(work.census.shape, work.seq_len) * tokens / lay.tp
    rate = dev.matmul_rate(work.compute_dtype, matmul_size(work, lay)) * dev.block_efficiency
    saved = work.census.activations.elements(tokens, lay.tp, lay.sp) * work.act_bytes
    compute = flops / rate + ELEMENTWISE_PASSES * saved / (dev.memory_bandwidth_gbs * 1e9) + FORWARD_OPS_PER_BLOCK * dev.op_overhead_us * 1e-6
    hidden = tokens * work.census.shape.d_model * work.act_bytes
    link = cluster.link(lay.tp)
    comm = (
        link.seconds("all_gather", hidden, lay.tp) + link.seconds("reduce_scatter", hidden, lay.tp)
        if lay.sp
        else link.seconds("all_reduce", hidden, lay.tp)
    )
    return compute, 2 * comm


def head_pass(work: Workload, lay: Layout, cluster: ClusterSpec) -> float:
    """Seconds of the head's and loss's forward for one micro-batch (logits over this rank's vocabulary)."""
    dev, tokens = cluster.device, lay.micro_batch * work.seq_len
    share = work.census.at(lay.tp, lay.ep)
    flops = 2.0 * work.census.shape.d_model * share.vocab * tokens
    rate = dev.matmul_rate(work.compute_dtype, (tokens * work.census.shape.d_model * share.vocab) ** (1 / 3))
    softmax = 3 * share.vocab * tokens * 4 / (dev.memory_bandwidth_gbs * 1e9)
    comm = cluster.link(lay.tp).seconds("all_reduce", 3 * tokens * 4, lay.tp)  # the vocabulary-parallel loss's three reductions
    return flops / rate + softmax + comm + HEAD_OPS * dev.op_overhead_us * 1e-6


def embed_pass(work: Workload, lay: Layout, cluster: ClusterSpec) -> float:
    """Seconds of the embedding lookup (a gather, memory-bound) and, under tensor parallelism, its all-reduce."""
    tokens = lay.micro_batch * work.seq_len
    hidden = tokens * work.census.shape.d_model * work.act_bytes
    return 2 * hidden / (cluster.device.memory_bandwidth_gbs * 1e9) + cluster.link(lay.tp).seconds("all_reduce", hidden, lay.tp)


def pass_costs(work: Workload, lay: Layout, cluster: ClusterSpec, bounds: tuple[int, ...]) -> PassCosts:
    """Per model stage: forward, input-gradient and weight-gradient seconds of one micro-batch (backward = 2 x forward,
    split evenly; tp collectives both ways; a recomputing stage runs its forward again in backward)."""
    compute, comm = block_pass(work, lay, cluster)
    block = compute + comm
    head, embed = head_pass(work, lay, cluster), embed_pass(work, lay, cluster)
    stage_rank = {s: r for r in range(lay.pp) for s in lay.held_stages(r)}
    fwd, bwd, wgt = [], [], []
    recompute = 0.0
    for s in range(lay.stages):
        n = bounds[s + 1] - bounds[s]
        f = n * block + (embed if s == 0 else 0.0) + (head if s == lay.stages - 1 else 0.0)
        again = n * block if stage_rank[s] in lay.recompute else 0.0
        recompute += again
        fwd.append(f)
        bwd.append(f + again)
        wgt.append(f - n * comm)  # the weight gradient needs no tensor-parallel collective
    tokens = lay.micro_batch * work.seq_len
    message = tokens * work.census.shape.d_model * work.act_bytes / (lay.tp if lay.sp else 1)
    p2p = cluster.link(lay.world).seconds("p2p", message, 2) if lay.pp > 1 else 0.0
    tp_comm = work.census.shape.n_layer / lay.pp * comm * 2  # one rank's blocks, forward and input-gradient passes
    return PassCosts(tuple(fwd), tuple(bwd), tuple(wgt), p2p, tp_comm, recompute / lay.pp)


def pipeline_seconds(lay: Layout, costs: PassCosts, *, exact: bool) -> tuple[float, float]:
    """(step, bubble) seconds of the micro-batches' passes: the simulator when `exact`, else a closed form."""
    per_stage = [f + b + w for f, b, w in zip(costs.forward, costs.backward, costs.weight)]
    m, p = lay.microbatches, lay.pp
    if p == 1:
        busy = m * per_stage[0]
        return busy, 0.0
    per_rank = [sum(per_stage[s] for s in lay.held_stages(r)) for r in range(p)]
    if exact:
        sim = simulate(build_schedule(lay.schedule, p, m, lay.chunks), Costs(costs.forward, costs.backward, costs.weight, p2p=costs.p2p))
        return sim.step_time, sim.step_time - sum(sim.busy) / p
    return closed_form_step(lay, per_rank, costs)


def closed_form_step(lay: Layout, per_rank: list[float], costs: PassCosts) -> tuple[float, float]:
    """The pipeline step without simulation: the slowest rank's work plus the schedule's published bubble."""
    m, p, v = lay.microbatches, lay.pp, lay.chunks
    slowest, mean = max(per_rank), sum(per_rank) / p
    hops = 2 * (p - 1) * costs.p2p
    if lay.schedule == "chimera":
        work = m * slowest / 2
        bubble = (p - 2) / 2 * mean / 2 + hops / 2
    elif lay.schedule == "zb-h1":
        work = m * slowest
        fb_w = [f + b - w for f, b, w in zip(costs.forward, costs.backward, costs.weight)]
        bubble = (p - 1) * sum(fb_w) / len(fb_w) + hops
    else:
        work = m * slowest
        bubble = (p - 1) * mean / v + hops * (1 if lay.schedule != "interleaved" else v)
    return work + bubble, bubble + (slowest - mean) * m


def bytes_per(lay: Layout, work: Workload) -> tuple[int, int]:
    """(parameter, gradient) bytes of the compute copies the data-parallel traffic moves."""
    p, g, _ = STATE_BYTES_ZERO0 if lay.zero == 0 else BYTES_PER_PARAM[work.param_dtype]
    return p, g


def data_parallel_seconds(work: Workload, lay: Layout, cluster: ClusterSpec, elements: float, backward: float) -> float:
    """Exposed seconds of the gradient reduction and ZeRO's all-gathers of `elements` parameters on the data-parallel
    link; without a pipeline the reductions overlap `backward` (a micro-batch's backward on the rank), as the runtime's
    bucket hooks do; a pipeline reduces once, after its passes."""
    if lay.data_ranks == 1:
        return 0.0
    p, g = bytes_per(lay, work)
    link, n = cluster.link(lay.tp * lay.data_ranks), lay.data_ranks
    hides = cluster.device.comm_overlap
    overlap = 0.0 if lay.pp > 1 else backward * hides
    if lay.zero == 0:
        last_bucket = min(g * elements, work.bucket_mb * 2**20)  # the last bucket's reduction starts after backward ends
        return max(link.seconds("all_reduce", g * elements, n) - overlap, link.seconds("all_reduce", last_bucket, n))
    gather = link.seconds("all_gather", p * elements, n)
    if lay.zero in (1, 2):
        scatter = link.seconds("reduce_scatter", g * elements, n)
        each = scatter * (lay.microbatches if lay.zero == 2 and lay.pp == 1 else 1)
        hidden = overlap * (lay.microbatches if lay.zero == 2 else 1)
        return max(each - hidden, 0.0) + gather
    traffic = lay.microbatches * (2 * gather + link.seconds("reduce_scatter", g * elements, n))
    return max(traffic - 1.5 * backward * lay.microbatches * hides, 0.0) + gather / max(1, work.census.shape.n_layer)


def optimizer_seconds(work: Workload, lay: Layout, cluster: ClusterSpec, elements: float) -> float:
    """The AdamW step over the rank's optimizer elements (its share of `elements` under ZeRO), memory-bound."""
    local = elements / (lay.data_ranks if lay.zero or lay.offload.enabled else 1)
    return OPTIMIZER_BYTES_PER_ELEMENT * local / (cluster.device.memory_bandwidth_gbs * 1e9) + 40 * cluster.device.op_overhead_us * 1e-6


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
    routed = lay.micro_batch * work.seq_len * shape.d_model * work.routed_rows * work.act_bytes  # capacity-padded slots
    return 4 * lay.microbatches * moe_blocks * cluster.link(lay.tp * lay.ep).seconds("all_to_all", routed, lay.ep)


def offload_seconds(work: Workload, lay: Layout, cluster: ClusterSpec, elements: float, experts: float) -> float:
    """Seconds the offload tiers move a step's bytes for one rank: parameters read for forward and again for backward and
    written after the update, gradients written and read back, moments read and written; a node's devices share its
    host memory and disk bandwidth."""
    if not lay.offload.enabled:
        return 0.0
    tiers = placed(state_bytes(elements, lay, work, experts), lay)
    host, share = cluster.host, cluster.devices_per_node
    rate = {"host": host.memory_bandwidth_gbs * 1e9 / share, "disk": host.disk_bandwidth_gbs * 1e9 / share}
    return sum((3 * p + 2 * g + 2 * k) / rate[tier] for tier, (p, g, k) in tiers.items() if tier != "device")


def step_time(work: Workload, lay: Layout, cluster: ClusterSpec, bounds: tuple[int, ...], *, exact: bool = False) -> StepTime:
    """Seconds of one training step of `lay` on `cluster`, by part."""
    costs = pass_costs(work, lay, cluster, bounds)
    passes, bubble = pipeline_seconds(lay, costs, exact=exact)
    share = work.census.at(lay.tp, lay.ep)
    busiest = max(range(lay.pp), key=lambda r: rank_elements(share, lay, bounds, r))
    elements = rank_elements(share, lay, bounds, busiest)
    experts = sum(bounds[s + 1] - bounds[s] for s in lay.held_stages(busiest)) * share.experts
    backward = max(sum(costs.backward[s] + costs.weight[s] for s in lay.held_stages(r)) for r in range(lay.pp))
    passes += chimera_sync_seconds(lay, cluster, elements)
    m = lay.microbatches
    pp_comm = 2 * m * costs.p2p * max(1, lay.chunks) if lay.pp > 1 else 0.0
    return StepTime(
        passes,
        bubble,
        costs.tp_comm * m,
        pp_comm,
        data_parallel_seconds(work, lay, cluster, elements, backward),
        optimizer_seconds(work, lay, cluster, elements),
        costs.recompute * m,
        simulated=exact and lay.pp > 1,
        ep_comm=expert_seconds(work, lay, cluster),
        offload_io=offload_seconds(work, lay, cluster, elements, experts),
    )


def step_floor(work: Workload, lay: Layout, cluster: ClusterSpec) -> float:
    """A lower bound of `step_time` whatever the boundaries and recomputation: every rank's share of the passes equal
    to the mean (the costliest is at least that), the schedule's bubble on that mean, and the data-parallel traffic and
    optimizer step of an even share of the parameters (the largest rank holds at least that)."""
    compute, comm = block_pass(work, lay, cluster)
    whole = work.census.shape.n_layer * (3 * (compute + comm) - comm) + 3 * (embed_pass(work, lay, cluster) + head_pass(work, lay, cluster))
    mean = whole / lay.pp * (2 if lay.schedule == "chimera" and lay.pp > 1 else 1)  # a Chimera rank holds two stages
    per_stage = whole / lay.stages
    third = per_stage / 3
    flat = PassCosts((third,) * lay.stages, (third,) * lay.stages, (third,) * lay.stages, 0.0, 0.0, 0.0)
    passes = lay.microbatches * mean if lay.pp == 1 else closed_form_step(lay, [mean] * lay.pp, flat)[0]
    share = work.census.at(lay.tp, lay.ep)
    elements = (work.census.shape.n_layer * share.block + share.embed + share.head) / lay.pp
    return passes + data_parallel_seconds(work, lay, cluster, elements, mean) + optimizer_seconds(work, lay, cluster, elements)
