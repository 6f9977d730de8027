"""Time of one training step under a plan, from FLOPs, the cluster's rates and its links.

A block's passes are priced by `compute.py` (products, attention, elementwise traffic, launches, tensor-parallel
collectives), the pipeline turns per-stage costs into a step (`pipetime.py`), and `comm.py` prices what runs beside
or after the passes: the data-parallel gradient reduction (and ZeRO's all-gathers) less what the runtime overlaps with
backward, expert parallelism's all-to-alls. The optimizer step is memory-bound; offload adds the bytes its tiers move
per step (host memory or disk, shared by a node's devices), of which what the passes do not hide (the streamer reads
ahead while they compute) is exposed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from behemoth.planner.cluster import ClusterSpec
from behemoth.planner.comm import DataParallelTime, chimera_sync_seconds, data_parallel_time, depth_sync_seconds, expert_seconds
from behemoth.planner.compute import block_costs, block_pass, embed_pass, head_pass
from behemoth.planner.footprint import placed, rank_elements, state_bytes
from behemoth.planner.layout import Layout, Workload
from behemoth.planner.messages import inline_transfers, pipeline_message_seconds
from behemoth.planner.pipetime import (
    LISTED_SCHEDULES,
    SPLIT_SCHEDULES,
    PassCosts,
    closed_form_step,
    listed_floor,
    pipeline_seconds,
    scp_share,
    streamed_pipeline,
)
from behemoth.planner.stream_traffic import streamed_pipeline_dp_seconds

OPTIMIZER_BYTES_PER_ELEMENT = 36  # AdamW reads parameter, gradient and two moments, writes three, plus temporaries
OPTIMIZER_OPS = 40  # operators one AdamW step launches (multi-tensor kernels over the rank's parameters)


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
    dp_traffic: float = 0.0  # the data-parallel collectives' seconds on their link; `dp_comm` is what is exposed, plus their messages' CPU
    cp_comm: float = 0.0  # context parallelism's exposed ring hops or all-to-alls, inside the passes
    dp_contention: float = 0.0  # of `dp_comm`: what the computation loses while data-parallel traffic runs beside it

    @property
    def offload(self) -> float:
        return max(self.offload_io - self.passes, 0.0)

    @property
    def total(self) -> float:
        return self.passes + self.dp_comm + self.optimizer + self.ep_comm + self.offload


def pass_costs(work: Workload, lay: Layout, cluster: ClusterSpec, bounds: tuple[int, ...]) -> PassCosts:
    """Per model stage: forward, input-gradient and weight-gradient seconds of one micro-batch (tp collectives in the
    first two; the embedding's and head's backward priced as their forward, once per gradient pass; a recomputing
    stage runs its forward again before its input-gradient pass; on CPU processes, the CPU its messages to and from
    other ranks cost)."""
    c = block_costs(work, lay, cluster)
    head, embed = head_pass(work, lay, cluster), embed_pass(work, lay, cluster)
    stage_rank = {s: r for r in range(lay.pp) for s in lay.held_stages(r)}
    inline = pipeline_message_seconds(work, lay, cluster)

    def message_ends(s: int) -> int:
        """Messages a pass of stage s sends or receives (its input from the stage before, its output to the one after,
        where that stage is on another rank): each costs the rank's CPU (`ClusterSpec.message_cpu_seconds`)."""
        if lay.schedule == "chimera":  # each of its two pipelines holds its stages on p different ranks
            return sum(0 <= t < lay.stages for t in (s - 1, s + 1))
        return sum(0 <= t < lay.stages and stage_rank[t] != stage_rank[s] for t in (s - 1, s + 1))

    fwd, bwd, wgt = [], [], []
    recompute = 0.0
    streamed = streamed_pipeline(lay)
    for s in range(lay.stages):
        n = bounds[s + 1] - bounds[s]
        ends = (embed if s == 0 else 0.0) + (head if s == lay.stages - 1 else 0.0)
        again = n * (c.forward + c.comm) if stage_rank[s] in lay.recompute or streamed else n * c.selective
        twice = again if streamed and lay.schedule in SPLIT_SCHEDULES and s > 0 else 0.0  # a streamed W recomputes again
        recompute += again + twice
        waits = inline_transfers(work, lay, s) * inline + message_ends(s) * cluster.message_cpu_seconds
        fwd.append(n * (c.forward + c.comm) + ends + waits)
        bwd.append(n * (c.input_grad + c.comm) + ends + again + waits)
        wgt.append(n * c.weight_grad + ends + twice)
    if lay.schedule == "1f1b-scp" and lay.pp > 1 and not streamed:  # the schedule's R passes: each rank but the last reruns most forwards
        recompute += sum(fwd[s] * scp_share(lay, s) for s in range(lay.stages))
    p2p = pipeline_message_seconds(work, lay, cluster)
    tp_comm = work.census.shape.n_layer / lay.pp * c.comm * 2  # one rank's blocks, forward and input-gradient passes
    context = work.census.shape.n_layer / lay.pp * c.context
    return PassCosts(tuple(fwd), tuple(bwd), tuple(wgt), p2p, tp_comm, recompute / lay.pp, context)


def optimizer_seconds(work: Workload, lay: Layout, cluster: ClusterSpec, elements: float) -> float:
    """The AdamW step over the rank's optimizer elements (its share of `elements` under ZeRO): at the rate
    `behemoth calibrate` measured (DeviceSpec.adamw), else memory-bound; zero for a rank that steps nothing."""
    local = elements / (lay.shard_ranks if lay.zero or lay.offload.enabled else 1)
    dev = cluster.device
    if dev.adamw is not None:
        return dev.adamw.seconds(local)
    return dev.issued(OPTIMIZER_BYTES_PER_ELEMENT * local / (dev.memory_bandwidth_gbs * 1e9), OPTIMIZER_OPS) if local > 0 else 0.0


def offload_seconds(work: Workload, lay: Layout, cluster: ClusterSpec, elements: float, experts: float) -> float:
    """Seconds the offload tiers move a step's bytes for one rank: parameters read for forward and again for backward (and
    for a streamed stage's weight passes once more) and written after the update, gradients written and read back,
    moments read and written; a node's devices share its host memory and disk bandwidth."""
    if not lay.offload.enabled:
        return 0.0
    tiers = placed(state_bytes(elements, lay, work, experts), lay)
    host, share = cluster.host, cluster.devices_per_node
    rate = {"host": host.memory_bandwidth_gbs * 1e9 / share, "disk": host.disk_bandwidth_gbs * 1e9 / share}
    reads = 4 if streamed_pipeline(lay) and lay.schedule in SPLIT_SCHEDULES else 3  # a streamed W reads its units again
    return sum((reads * p + 2 * g + 2 * k) / rate[tier] for tier, (p, g, k) in tiers.items() if tier != "device")


def step_time(work: Workload, lay: Layout, cluster: ClusterSpec, bounds: tuple[int, ...], *, exact: bool = False) -> StepTime:
    """Seconds of one training step of `lay` on `cluster`, by part."""
    costs = pass_costs(work, lay, cluster, bounds)
    passes, bubble = shared_cores(cluster, lay, costs, exact=exact)
    share = work.share(lay)
    busiest = max(range(lay.pp), key=lambda r: rank_elements(share, lay, bounds, r))
    elements = rank_elements(share, lay, bounds, busiest)
    experts = sum(bounds[s + 1] - bounds[s] for s in lay.held_stages(busiest)) * share.experts
    forward = max(sum(costs.forward[s] for s in lay.held_stages(r)) for r in range(lay.pp))
    backward = max(sum(costs.backward[s] + costs.weight[s] for s in lay.held_stages(r)) for r in range(lay.pp))
    passes += chimera_sync_seconds(lay, cluster, elements) + depth_sync_seconds(work, lay, cluster, elements)
    m = lay.microbatches
    pp_comm = 2 * m * costs.p2p * max(1, lay.chunks) if lay.pp > 1 else 0.0
    if streamed_pipeline(lay):  # each stay of a unit gathers it (and reduce-scatters its gradient), exposed
        streamed = streamed_pipeline_dp_seconds(work, lay, cluster, bounds)
        dp = DataParallelTime(streamed, streamed)
    else:
        dp = data_parallel_time(work, lay, cluster, elements, forward, backward)
    return StepTime(
        passes,
        bubble,
        costs.tp_comm * m,
        pp_comm,
        dp.exposed,
        optimizer_seconds(work, lay, cluster, elements),
        costs.recompute * m,
        simulated=exact and lay.pp > 1,
        ep_comm=expert_seconds(work, lay, cluster),
        offload_io=offload_seconds(work, lay, cluster, elements, experts),
        dp_traffic=dp.traffic,
        cp_comm=costs.context * m,
        dp_contention=dp.contention,
    )


def shared_cores(cluster: ClusterSpec, lay: Layout, costs: PassCosts, *, exact: bool) -> tuple[float, float]:
    """(passes, bubble) of the pipeline, also when a node's ranks share fewer cores than there are ranks (CPU
    processes): the rates were measured with every rank computing, so a rank idle in the pipeline's bubble lends its
    share to the busy ones. The step is then the larger of the ranks' mean busy time and the critical path with every
    pass at the rate of a rank with its cores to itself (`sharing` times faster) and every message at its own latency
    (a rank's wait for a core when a message wakes it, `ClusterSpec.wake_seconds`, included in it)."""
    passes, bubble = pipeline_seconds(lay, costs, exact=exact)
    sharing = cluster.core_sharing
    if sharing <= 1.0 or bubble <= 0.0:
        return passes, bubble
    busy = passes - bubble
    alone = replace(
        costs,
        forward=tuple(c / sharing for c in costs.forward),
        backward=tuple(c / sharing for c in costs.backward),
        weight=tuple(c / sharing for c in costs.weight),
    )
    shared = max(busy, pipeline_seconds(lay, alone, exact=exact)[0])
    return shared, shared - busy


def shared_floor(cluster: ClusterSpec, passes: float, bubble: float) -> float:
    """`shared_cores`'s bound from a step already priced at the shared rate: its messages scaled with it (a lower bound)."""
    sharing = cluster.core_sharing
    if sharing <= 1.0 or bubble <= 0.0:
        return passes
    return max(passes - bubble, passes / sharing)


def step_floor(work: Workload, lay: Layout, cluster: ClusterSpec) -> float:
    """A lower bound of `step_time` whatever the boundaries and recomputation: every rank's share of the passes equal
    to the mean (the costliest is at least that), the schedule's bubble on that mean, and the data-parallel traffic and
    optimizer step of an even share of the parameters (the largest rank holds at least that)."""
    compute, comm = block_pass(work, lay, cluster)
    whole = work.census.shape.n_layer * (3 * (compute + comm) - comm) + 3 * (embed_pass(work, lay, cluster) + head_pass(work, lay, cluster))
    mean = whole / lay.pp * (2 if lay.schedule == "chimera" and lay.pp > 1 else 1)  # a Chimera rank holds two stages
    per_stage = whole / lay.stages
    third = per_stage / 3
    p2p = pipeline_message_seconds(work, lay, cluster)
    flat = PassCosts((third,) * lay.stages, (third,) * lay.stages, (third,) * lay.stages, p2p, 0.0, 0.0)
    if lay.pp == 1:
        passes = lay.microbatches * mean
    elif lay.schedule in LISTED_SCHEDULES:
        passes = listed_floor(lay, mean, third, p2p)
    else:
        passes = closed_form_step(lay, [mean] * lay.pp, flat)[0]
    share = work.share(lay)
    elements = (work.census.shape.n_layer * share.block + share.embed + share.head) / lay.pp
    passes = shared_floor(cluster, passes, passes - lay.microbatches * mean) if lay.pp > 1 else passes
    return passes + data_parallel_time(work, lay, cluster, elements, mean, mean).exposed + optimizer_seconds(work, lay, cluster, elements)
