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

from behemoth.models.shape import LayerCosts
from behemoth.parallel.pipeline.analysis.simulate import Costs, simulate
from behemoth.parallel.pipeline.partition import balance_stages
from behemoth.parallel.pipeline.schedules import build_schedule
from behemoth.parallel.pipeline.shifted import recomputed
from behemoth.planner.attention import attention_seconds, context_comm_seconds
from behemoth.planner.cluster import ClusterSpec
from behemoth.planner.elementwise import elementwise_seconds
from behemoth.planner.footprint import STATE_BYTES_ZERO0, placed, rank_elements, state_bytes
from behemoth.planner.layout import Layout, Workload
from behemoth.planner.memory import BYTES_PER_PARAM
from behemoth.planner.messages import inline_transfers, pipeline_message_seconds

FORWARD_OPS_PER_BLOCK = 30  # operators one block's forward launches (norms, matrices, attention, activation, adds)
HEAD_OPS = 12  # final norm, head, loss
OPTIMIZER_BYTES_PER_ELEMENT = 36  # AdamW reads parameter, gradient and two moments, writes three, plus temporaries


@dataclass(frozen=True)
class PassCosts:
    """Seconds of one micro-batch's passes through each model stage, and of the pipeline's messages."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]  # input-gradient pass (a full backward is backward + weight)
    weight: tuple[float, ...]
    p2p: float
    tp_comm: float  # of all passes of one micro-batch through the whole model, included above
    recompute: float  # of all passes of one micro-batch, included above
    context: float = 0.0  # context parallelism's exposed seconds of one micro-batch through one rank's blocks, included above


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
    dp_traffic: float = 0.0  # the data-parallel collectives' seconds on their link, of which `dp_comm` is exposed
    cp_comm: float = 0.0  # context parallelism's exposed ring hops or all-to-alls, inside the passes
    dp_contention: float = 0.0  # of `dp_comm`: what the computation loses while data-parallel traffic runs beside it

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


@dataclass(frozen=True)
class BlockCosts:
    """Seconds of one block for one micro-batch on one rank: the forward, the input-gradient and the weight-gradient
    passes (computation only), and the tensor-parallel collectives of one pass (forward; input-gradient the same)."""

    forward: float
    input_grad: float
    weight_grad: float
    comm: float
    context: float = 0.0  # context parallelism's exposed seconds, forward and input-gradient passes (included above)
    selective: float = 0.0  # what an op-level checkpointing policy reruns before the input-gradient pass (not included)

    @property
    def passes(self) -> float:
        """Forward, input-gradient and weight-gradient passes with their collectives."""
        return self.forward + self.input_grad + self.weight_grad + 2 * self.comm


def block_products(work: Workload, lay: Layout) -> list[tuple[float, float, float, float]]:
    """(batch, m, n, k) of each matrix product of one block's forward on one rank: q/k/v, the attention output, the
    MLP (gate and up fused, down), an MoE block's router and its E / ep local experts over the tokens routed to them."""
    shape, tokens, t = work.census.shape, lay.tokens(work.seq_len), lay.tp
    d = shape.d_model
    products: list[tuple[float, float, float, float]] = [(1, tokens, (shape.q_width + 2 * shape.kv_width) / t, d), (1, tokens, d, shape.q_width / t)]
    up = (2 if shape.gated else 1) * shape.ffn / t
    experts = shape.experts[0] if shape.experts else 0
    if experts:
        local, routed = experts / lay.ep, tokens * max(1, shape.top_k) * lay.ep / experts
        products += [(1, tokens, experts, d), (local, routed, up, d), (local, routed, d, shape.ffn / t)]
    else:
        products += [(1, tokens, up, d), (1, tokens, d, shape.ffn / t)]
    return products


_BLOCK_COSTS: dict[tuple, tuple] = {}  # the search prices thousands of layouts sharing a few block shapes (the keys' objects kept alive)


def block_costs(work: Workload, lay: Layout, cluster: ClusterSpec) -> BlockCosts:
    """One block's passes (remembered per shape, degrees and hardware; see `price_block`)."""
    key = (
        id(work.census),
        work.seq_len,
        work.compute_dtype,
        lay.micro_batch,
        lay.tp,
        lay.sp,
        lay.ep,
        lay.cp,
        lay.cp_mode,
        lay.tp_mode,
        lay.depth,
        work.dropout > 0,
        work.op_checkpointing,
        id(cluster.device),
        id(cluster.intra_node),
    )
    found = _BLOCK_COSTS.get(key)
    if found is None or found[0] is not work.census or found[1] is not cluster.device or found[2] is not cluster.intra_node:
        if len(_BLOCK_COSTS) > 4096:
            _BLOCK_COSTS.clear()
        found = _BLOCK_COSTS[key] = (work.census, cluster.device, cluster.intra_node, price_block(work, lay, cluster))
    return found[3]


def price_block(work: Workload, lay: Layout, cluster: ClusterSpec) -> BlockCosts:
    """One block's passes: each product at its (m, n, k) rate (backward: the input-gradient product (m, k, n) and the
    weight-gradient product (k, n, m)), attention, elementwise traffic (`elementwise.py`), a launch per operator."""
    dev, dtype, tokens = cluster.device, work.compute_dtype, lay.tokens(work.seq_len)
    products = grid_products(work, lay)
    forward = sum(dev.gemm_seconds(dtype, m, n, k, b) for b, m, n, k in products)
    input_grad = sum(dev.gemm_seconds(dtype, m, k, n, b) for b, m, n, k in products)
    weight_grad = sum(dev.gemm_seconds(dtype, k, n, m, b) for b, m, n, k in products)
    attn_f, attn_b = attention_seconds(work, lay, cluster)
    cp_f, cp_b = context_comm_seconds(work, lay, cluster)  # exposed ring hops or Ulysses all-to-alls
    elementwise, elementwise_b = elementwise_seconds(work, lay, cluster)
    launches = FORWARD_OPS_PER_BLOCK * dev.op_overhead_us * 1e-6
    eff = dev.block_efficiency
    rerun = sum(dev.gemm_seconds(dtype, m, n, k, b) for b, m, n, k in op_products(work, lay)[1::2]) / eff + elementwise + launches
    hidden = tokens * work.census.shape.d_model * work.act_bytes
    if lay.gridded:
        whole = block_products(work, lay.but(tp=1, tp_mode="1d"))
        comm = sum(grid_seconds(work, lay, cluster, b * m * k, b * k * n, b * m * n) for b, m, n, k in whole) / 2
    elif lay.sp:
        comm = cluster.collective("all_gather", hidden, lay.tp) + cluster.collective("reduce_scatter", hidden, lay.tp)
    else:
        comm = cluster.collective("all_reduce", hidden, lay.tp)
    return BlockCosts(
        (forward + attn_f) / eff + elementwise + launches + cp_f,
        (input_grad + attn_b) / eff + elementwise_b + launches + cp_b,
        weight_grad / eff + launches / 2,
        2 * comm,
        cp_f + cp_b,
        rerun if work.op_checkpointing else 0.0,
    )


def grid_products(work: Workload, lay: Layout) -> list[tuple[float, float, float, float]]:
    """`block_products` as a grid or cube runs them: SUMMA's q steps of a (tokens/(q d), n/q, k/q) product per linear
    on a 2-D (d = 1) or 2.5-D grid; one (tokens/q, n/q, k/q) product of the gathered operands on a q^3 cube."""
    if not lay.gridded:
        return block_products(work, lay)
    q, whole = lay.grid, block_products(work, lay.but(tp=1, tp_mode="1d"))
    if lay.tp_mode == "3d":
        return [(b, m / q, n / q, k / q) for b, m, n, k in whole]
    return [(b * q, m / (q * lay.depth), n / q, k / q) for b, m, n, k in whole]


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
    step = cluster.collective("p2p", (x / lay.depth + w) / q**2 * work.act_bytes, lay.tp)
    return 3 * q * step


def cube_seconds(work: Workload, lay: Layout, cluster: ClusterSpec, x: float, w: float, y: float) -> float:
    """Seconds of one 3-D linear's six collectives over lines of q ranks (`cube.cube_volume`): forward all-gathers X
    along O and W along T and reduce-scatters Y along I; backward all-gathers dY and reduce-scatters dX and dW; each
    gathered (scattered) tensor q times the rank's 1/q^3 piece, priced by the alpha-beta model on the cube's link."""
    q = lay.grid

    def line(op: str, whole: float) -> float:
        return cluster.collective(op, whole / q**2 * work.act_bytes, q)

    forward = line("all_gather", x) + line("all_gather", w) + line("reduce_scatter", y)
    return forward + line("all_gather", y) + line("reduce_scatter", x) + line("reduce_scatter", w)


def depth_sync_seconds(work: Workload, lay: Layout, cluster: ClusterSpec, elements: float) -> float:
    """2.5-D: the all-reduce of every weight gradient over the d grids that hold the same pieces, once per step after
    the passes (`TensorParallel2D.finish_grads`), on the tp group's link (ranks q^2 apart)."""
    if lay.tp_mode != "2.5d" or lay.depth == 1 or lay.tp == 1:
        return 0.0
    return cluster.collective("all_reduce", bytes_per(lay, work)[1] * elements, lay.depth, lay.grid**2)


def op_products(work: Workload, lay: Layout) -> list[tuple[float, float, float, float]]:
    """One block's forward products one by one, in the order a block calls them (q, k, v, the output projection; the
    MLP's gate, up and down, or its two): what an op-level checkpointing policy counts. torchtitan's `op` policy
    (torchtitan/parallelisms/parallelize_llama.py, `_custom_policy`: "saves output of all compute ops, except every
    second mm") reruns the 2nd, 4th and 6th of them, and every elementwise operator, before the block's backward."""
    shape, tokens, t = work.census.shape, lay.tokens(work.seq_len), lay.tp
    if shape.experts and shape.experts[0]:
        return block_products(work, lay)
    d, q, kv, ffn = shape.d_model, shape.q_width / t, shape.kv_width / t, shape.ffn / t
    attention: list[tuple[float, float, float, float]] = [(1, tokens, q, d), (1, tokens, kv, d), (1, tokens, kv, d), (1, tokens, d, q)]
    return attention + [(1, tokens, ffn, d)] * (2 if shape.gated else 1) + [(1, tokens, d, ffn)]


def block_pass(work: Workload, lay: Layout, cluster: ClusterSpec) -> tuple[float, float]:
    """(compute, tp communication) of one block, compute as a third of its three passes' computation, so that the
    stage cutter's `3 x (compute + comm) - comm` is the block's forward, input-gradient and weight-gradient passes."""
    c = block_costs(work, lay, cluster)
    return (c.forward + c.input_grad + c.weight_grad) / 3, c.comm


def head_pass(work: Workload, lay: Layout, cluster: ClusterSpec) -> float:
    """Seconds of the head's and loss's forward for one micro-batch (logits over this rank's vocabulary)."""
    dev, tokens = cluster.device, lay.tokens(work.seq_len)
    share = work.share(lay)
    logits = dev.gemm_seconds(work.compute_dtype, tokens, share.vocab, work.census.shape.d_model)
    softmax = 3 * share.vocab * tokens * 4 / (dev.memory_bandwidth_gbs * 1e9)
    comm = cluster.collective("all_reduce", 3 * tokens * 4, lay.tp)  # the vocabulary-parallel loss's three reductions
    if lay.gridded:  # the head is a grid (cube) product too (forward's share of its three passes)
        d, vocab = work.census.shape.d_model, share.vocab * lay.tp
        comm += grid_seconds(work, lay, cluster, tokens * d, d * vocab, tokens * vocab) / 3
    return logits / dev.block_efficiency + softmax + comm + HEAD_OPS * dev.op_overhead_us * 1e-6


def embed_pass(work: Workload, lay: Layout, cluster: ClusterSpec) -> float:
    """Seconds of the embedding lookup (a gather, memory-bound) and, under tensor parallelism, its all-reduce."""
    tokens = lay.tokens(work.seq_len)
    hidden = tokens * work.census.shape.d_model * work.act_bytes
    lookup = 2 * hidden / (cluster.device.memory_bandwidth_gbs * 1e9)
    if lay.gridded:  # each rank looks up its block: only the table's pieces are gathered (not priced)
        return lookup / lay.tp
    return lookup + cluster.collective("all_reduce", hidden, lay.tp)


def pass_costs(work: Workload, lay: Layout, cluster: ClusterSpec, bounds: tuple[int, ...]) -> PassCosts:
    """Per model stage: forward, input-gradient and weight-gradient seconds of one micro-batch (tp collectives in the
    first two; the embedding's and head's backward priced as their forward, once per gradient pass; a recomputing
    stage runs its forward again before its input-gradient pass)."""
    c = block_costs(work, lay, cluster)
    head, embed = head_pass(work, lay, cluster), embed_pass(work, lay, cluster)
    stage_rank = {s: r for r in range(lay.pp) for s in lay.held_stages(r)}
    inline = pipeline_message_seconds(work, lay, cluster)
    fwd, bwd, wgt = [], [], []
    recompute = 0.0
    streamed = streamed_pipeline(lay)
    for s in range(lay.stages):
        n = bounds[s + 1] - bounds[s]
        ends = (embed if s == 0 else 0.0) + (head if s == lay.stages - 1 else 0.0)
        again = n * (c.forward + c.comm) if stage_rank[s] in lay.recompute or streamed else n * c.selective
        twice = again if streamed and lay.schedule in SPLIT_SCHEDULES and s > 0 else 0.0  # a streamed W recomputes again
        recompute += again + twice
        waits = inline_transfers(work, lay, s) * inline
        fwd.append(n * (c.forward + c.comm) + ends + waits)
        bwd.append(n * (c.input_grad + c.comm) + ends + again + waits)
        wgt.append(n * c.weight_grad + ends + twice)
    if lay.schedule == "1f1b-scp" and lay.pp > 1 and not streamed:  # the schedule's R passes: each rank but the last reruns most forwards
        recompute += sum(fwd[s] * scp_share(lay, s) for s in range(lay.stages))
    p2p = pipeline_message_seconds(work, lay, cluster)
    tp_comm = work.census.shape.n_layer / lay.pp * c.comm * 2  # one rank's blocks, forward and input-gradient passes
    context = work.census.shape.n_layer / lay.pp * c.context
    return PassCosts(tuple(fwd), tuple(bwd), tuple(wgt), p2p, tp_comm, recompute / lay.pp, context)


SPLIT_SCHEDULES = ("zb-h1", "zbv", "dualpipev")  # a backward split into input-gradient (BI) and weight (W) passes


def streamed_pipeline(lay: Layout) -> bool:
    """Whether each pipeline stage streams its own units (offload/stage_stream.py): a streamed stage keeps each block's
    input and recomputes the block in its backward (a split backward: in its BI and again in its W)."""
    return lay.pp > 1 and lay.offload.streams


def scp_share(lay: Layout, rank: int) -> float:
    """1f1b-scp: the share of a step's micro-batches pipeline rank `rank` recomputes (its schedule's R passes)."""
    return len(recomputed(rank, lay.pp, lay.microbatches)) / lay.microbatches


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


LISTED_SCHEDULES = ("zbv", "dualpipev", "1f1b-scp")  # priced from their own action lists (simulated at uniform costs)
UNIFORM_SIMULATE_LIMIT = 6_000  # actions: a listed pipeline this short is simulated at uniform costs while searching


@lru_cache(maxsize=4096)
def uniform_step(name: str, p: int, m: int, backward: float, weight: float, p2p: float) -> tuple[float, float]:
    """(step, mean busy) of schedule `name`'s action lists simulated with every stage costing forward 1, `backward` and
    `weight` (per model stage) and messages `p2p`: the exact step of uniform stages, in forward units."""
    schedule = build_schedule(name, p, m, 2 if name in ("zbv", "dualpipev") else 1)
    sim = simulate(schedule, Costs(1.0, backward, weight, p2p=p2p))
    return sim.step_time, sum(sim.busy) / p


def listed_step(lay: Layout, per_rank: list[float], costs: PassCosts) -> tuple[float, float]:
    """(step, bubble) of a V-shaped or shifted schedule: its action lists simulated with every stage at the mean
    per-stage forward f, input-gradient b and weight w passes and the p2p latency (exact for uniform stages), plus the
    slowest rank's excess over the mean on every micro-batch. A pipeline of more than 6,000 actions takes a closed form
    read off the same simulations (`closed_listed_step`)."""
    m, p, n = lay.microbatches, lay.pp, len(costs.forward)
    f, b, w = (sum(x) / n for x in (costs.forward, costs.backward, costs.weight))
    excess = m * (max(per_rank) - sum(per_rank) / p)
    if p * m * lay.chunks * 6 > UNIFORM_SIMULATE_LIMIT or f <= 0:
        step, busy = closed_listed_step(lay.schedule, p, m, f, b, w)
        hops = 2 * (p - 1) * costs.p2p
        return step + hops + excess, step + hops - busy + excess
    step, busy = uniform_step(lay.schedule, p, m, b / f, w / f, costs.p2p / f)
    return step * f + excess, (step - busy) * f + excess


def closed_listed_step(name: str, p: int, m: int, f: float, b: float, w: float) -> tuple[float, float]:
    """(step, mean busy) at uniform per-stage passes f, b, w and no p2p latency, in closed form: 1f1b-scp's is
    `closed_form_bubble`'s m(2f+B) + (p-1)(f+B) - 3f (B = b + w; exact for m >= max(p, 3), f <= B), ZBV's and (an
    approximation) DualPipeV's 2m(f+b+w) + (p-1) max(f, b) + (p-2) max(f-b, 0) (exact for m >= 2p-1 and w >= f,
    tests/test_planner_schedules.py)."""
    if name == "1f1b-scp":
        return m * (2 * f + b + w) + (p - 1) * (f + b + w) - 3 * f, m * (f + b + w) + (p - 1) * (m - 1) * f / p
    busy = 2 * m * (f + b + w)
    return busy + (p - 1) * max(f, b) + (p - 2) * max(f - b, 0.0), busy


def listed_floor(lay: Layout, mean: float, forward: float, p2p: float) -> float:
    """A lower bound of `listed_step` for ranks of `mean` work: the last rank's first forward waits for p - 1 forwards."""
    return lay.microbatches * mean + (lay.pp - 1) * forward + 2 * (lay.pp - 1) * p2p


def closed_form_step(lay: Layout, per_rank: list[float], costs: PassCosts) -> tuple[float, float]:
    """The pipeline step without simulation: the slowest rank's work plus the schedule's published bubble."""
    m, p, v = lay.microbatches, lay.pp, lay.chunks
    slowest, mean = max(per_rank), sum(per_rank) / p
    hops = 2 * (p - 1) * costs.p2p
    if lay.schedule in LISTED_SCHEDULES:
        return listed_step(lay, per_rank, costs)
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


@dataclass(frozen=True)
class DataParallelTime:
    """A step's data-parallel / ZeRO collectives: their seconds on the link (`traffic`) and what computation does not
    hide (`exposed`): collectives run on their own stream beside the passes, up to `comm_overlap` of the compute they
    can run behind; the first gather of a pass and the last reduction after backward are always exposed; while one
    runs beside the passes they lose `overlap_slowdown` of their rate (`contention`, included in `exposed`)."""

    traffic: float
    exposed: float
    contention: float = 0.0


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
    ZeRO-2) and the parameters' all-gather after the step; ZeRO-3's per-unit all-gathers in forward and backward and
    reduce-scatters in backward, every micro-batch, each behind one unit's share of `forward` and `backward` (the
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
        return DataParallelTime(traffic, exposed, contention)
    if lay.zero in (1, 2):
        scatter, last = bucket_seconds(cluster, "reduce_scatter", g * elements, bucket, n, tp)
        gather = cluster.collective("all_gather", p * elements, n, tp)
        syncs = m if lay.zero == 2 and lay.pp == 1 else 1
        exposed, contention = behind(cluster, scatter, backward, last)
        return DataParallelTime(syncs * scatter + gather, syncs * exposed + gather, syncs * contention)
    units = max(1, work.census.shape.n_layer // lay.pp)
    gather = cluster.collective("all_gather", p * elements / units, n, tp)
    scatter = cluster.collective("reduce_scatter", g * elements / units, n, tp)
    # forward: the first unit's gather waits; each later one hides behind the unit before it
    f_rest, f_slow = behind(cluster, gather, forward / units, 0.0)
    # backward: each unit's next gather and its own reduce-scatter share the collective stream behind its backward
    b_rest, b_slow = behind(cluster, gather + scatter, backward / units, 0.0)
    exposed_f = gather + (units - 1) * f_rest
    exposed_b = (units - 1) * b_rest + max(scatter, b_rest)
    contention = (units - 1) * (f_slow + b_slow)
    return DataParallelTime(m * units * (2 * gather + scatter), m * (exposed_f + exposed_b), m * contention)


def data_parallel_seconds(work: Workload, lay: Layout, cluster: ClusterSpec, elements: float, backward: float, forward: float | None = None) -> float:
    """Exposed seconds of `data_parallel_time` (forward defaults to half the backward, its FLOP share)."""
    return data_parallel_time(work, lay, cluster, elements, backward / 2 if forward is None else forward, backward).exposed


def optimizer_seconds(work: Workload, lay: Layout, cluster: ClusterSpec, elements: float) -> float:
    """The AdamW step over the rank's optimizer elements (its share of `elements` under ZeRO): at the rate
    `behemoth calibrate` measured (DeviceSpec.adamw), else memory-bound; zero for a rank that steps nothing."""
    local = elements / (lay.shard_ranks if lay.zero or lay.offload.enabled else 1)
    dev = cluster.device
    if dev.adamw is not None:
        return dev.adamw.seconds(local)
    return OPTIMIZER_BYTES_PER_ELEMENT * local / (dev.memory_bandwidth_gbs * 1e9) + 40 * dev.op_overhead_us * 1e-6 if local > 0 else 0.0


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
    return 4 * lay.microbatches * moe_blocks * cluster.collective("all_to_all", routed, lay.ep, lay.tp)


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
    passes, bubble = shared_cores(cluster, *pipeline_seconds(lay, costs, exact=exact))
    share = work.share(lay)
    busiest = max(range(lay.pp), key=lambda r: rank_elements(share, lay, bounds, r))
    elements = rank_elements(share, lay, bounds, busiest)
    experts = sum(bounds[s + 1] - bounds[s] for s in lay.held_stages(busiest)) * share.experts
    forward = max(sum(costs.forward[s] for s in lay.held_stages(r)) for r in range(lay.pp))
    backward = max(sum(costs.backward[s] + costs.weight[s] for s in lay.held_stages(r)) for r in range(lay.pp))
    passes += chimera_sync_seconds(lay, cluster, elements) + depth_sync_seconds(work, lay, cluster, elements)
    m = lay.microbatches
    pp_comm = 2 * m * costs.p2p * max(1, lay.chunks) if lay.pp > 1 else 0.0
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


def shared_cores(cluster: ClusterSpec, passes: float, bubble: float) -> tuple[float, float]:
    """(passes, bubble) when a node's ranks share fewer cores than there are ranks (CPU processes): the rates were
    measured with every rank computing, so a rank idle in the pipeline's bubble lends its share to the busy ones. The
    step is then the larger of the ranks' mean busy time and the critical path at the rate of a rank with its cores
    to itself (`sharing` times faster)."""
    sharing = cluster.core_sharing
    if sharing <= 1.0 or bubble <= 0.0:
        return passes, bubble
    busy = passes - bubble
    shared = max(busy, passes / sharing)
    return shared, shared - busy


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
    passes = shared_cores(cluster, passes, passes - lay.microbatches * mean)[0] if lay.pp > 1 else passes
    return passes + data_parallel_time(work, lay, cluster, elements, mean, mean).exposed + optimizer_seconds(work, lay, cluster, elements)
