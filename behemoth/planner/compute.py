"""What one block's computation costs one rank: its matrix products, attention and elementwise traffic, and the ends.

Each pass of a micro-batch through a block costs its matrix products at the device's rate for products of their
(m, n, k) (`cluster.DeviceSpec.gemm_seconds`; backward: each product's input-gradient and weight-gradient products),
its attention kernel (`attention.py`), its elementwise traffic at the memory bandwidth (`elementwise.py`) and a fixed
launch cost per operator (on a GPU, which runs kernels from a queue the host fills ahead of it, only where the launches
outlast the kernels: `DeviceSpec.async_launch`); tensor parallelism adds its collectives inside the passes (two all-reduces per block each
way, or with sequence parallelism two all-gathers and two reduce-scatters of the same bytes; a grid's or cube's in
`comm.py`), on the link the tensor-parallel group spans. The embedding and the head are priced on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from behemoth.planner.attention import attention_seconds, context_comm_seconds
from behemoth.planner.cluster import ClusterSpec
from behemoth.planner.comm import grid_seconds
from behemoth.planner.elementwise import elementwise_seconds
from behemoth.planner.layout import Layout, Workload

FORWARD_OPS_PER_BLOCK = 30  # operators one block's forward launches (norms, matrices, attention, activation, adds)
HEAD_OPS = 12  # final norm, head, loss


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
        cluster.wake_seconds,  # ring hops a rank waits for on shared cores
    )
    found = _BLOCK_COSTS.get(key)
    if found is None or found[0] is not work.census or found[1] is not cluster.device or found[2] is not cluster.intra_node:
        if len(_BLOCK_COSTS) > 4096:
            _BLOCK_COSTS.clear()
        found = _BLOCK_COSTS[key] = (work.census, cluster.device, cluster.intra_node, price_block(work, lay, cluster))
    return found[3]


def price_block(work: Workload, lay: Layout, cluster: ClusterSpec) -> BlockCosts:
    """One block's passes: each product at its (m, n, k) rate (backward: the input-gradient product (m, k, n) and the
    weight-gradient product (k, n, m)), attention, elementwise traffic (`elementwise.py`), a launch per operator (hidden
    behind the kernels on a device that queues them: `DeviceSpec.issued`)."""
    dev, dtype, tokens = cluster.device, work.compute_dtype, lay.tokens(work.seq_len)
    products = grid_products(work, lay)
    forward = sum(dev.gemm_seconds(dtype, m, n, k, b) for b, m, n, k in products)
    input_grad = sum(dev.gemm_seconds(dtype, m, k, n, b) for b, m, n, k in products)
    weight_grad = sum(dev.gemm_seconds(dtype, k, n, m, b) for b, m, n, k in products)
    attn_f, attn_b = attention_seconds(work, lay, cluster)
    cp_f, cp_b = context_comm_seconds(work, lay, cluster)  # exposed ring hops or Ulysses all-to-alls
    elementwise, elementwise_b = elementwise_seconds(work, lay, cluster)
    ops, eff = FORWARD_OPS_PER_BLOCK, dev.block_efficiency
    rerun = dev.issued(sum(dev.gemm_seconds(dtype, m, n, k, b) for b, m, n, k in op_products(work, lay)[1::2]) / eff + elementwise, ops)
    hidden = tokens * work.census.shape.d_model * work.act_bytes
    if lay.gridded:
        whole = block_products(work, lay.but(tp=1, tp_mode="1d"))
        comm = sum(grid_seconds(work, lay, cluster, b * m * k, b * k * n, b * m * n) for b, m, n, k in whole) / 2
    elif lay.sp:
        comm = cluster.collective("all_gather", hidden, lay.tp) + cluster.collective("reduce_scatter", hidden, lay.tp)
        comm += cluster.messages_cpu("all_gather", lay.tp) + cluster.messages_cpu("reduce_scatter", lay.tp)
    else:
        comm = cluster.collective("all_reduce", hidden, lay.tp) + cluster.messages_cpu("all_reduce", lay.tp)
    return BlockCosts(
        dev.issued((forward + attn_f) / eff + elementwise, ops) + cp_f,
        dev.issued((input_grad + attn_b) / eff + elementwise_b, ops) + cp_b,
        dev.issued(weight_grad / eff, ops / 2),
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
    comm += cluster.messages_cpu("all_reduce", lay.tp, 3)
    if lay.gridded:  # the head is a grid (cube) product too (forward's share of its three passes)
        d, vocab = work.census.shape.d_model, share.vocab * lay.tp
        comm += grid_seconds(work, lay, cluster, tokens * d, d * vocab, tokens * vocab) / 3
    return dev.issued(logits / dev.block_efficiency + softmax, HEAD_OPS) + comm


def embed_pass(work: Workload, lay: Layout, cluster: ClusterSpec) -> float:
    """Seconds of the embedding lookup (a gather, memory-bound) and, under tensor parallelism, its all-reduce."""
    tokens = lay.tokens(work.seq_len)
    hidden = tokens * work.census.shape.d_model * work.act_bytes
    lookup = 2 * hidden / (cluster.device.memory_bandwidth_gbs * 1e9)
    if lay.gridded:  # each rank looks up its block: only the table's pieces are gathered (not priced)
        return lookup / lay.tp
    return lookup + cluster.collective("all_reduce", hidden, lay.tp)
