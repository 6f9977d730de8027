"""What one block's attention costs one rank: the kernel by its FLOPs and memory traffic, and under context parallelism
(parallel.cp) the ring's or Ulysses' communication, exposed or hidden behind that kernel.

- **The kernel** (q queries against k keys, `heads` query heads of one micro-batch): a flash kernel runs the tiles the
  mask leaves (causal and square: half) at the device's `flash_efficiency` of peak, backward 2.5x forward (five
  products to two, the scores recomputed); materialized scores run the two batched products at their (m, n, k) rate
  plus the q x k scores' traffic (forward: written, read and written by the softmax, read; backward: seven passes);
  with dropout (`model.dropout`, Megatron-LM's and OPT's 0.1) the probabilities also pass through a dropout kernel
  each way (forward: read, written, a 1-byte mask written; backward: the gradient read, the mask read, written). A
  flash kernel draws its dropout mask in registers: no traffic.
- **Ring attention** (parallel/context/ring.py): rank i holds chunks i and 2C-1-i of 2C, and attends over C steps, the
  blocks `ring_steps` lists (the runtime's own table: the local causal block, then half a local block per step),
  merging each step's output into float32 accumulators. While a step computes, the K/V block (this rank's keys and
  values, in the compute dtype) travels to the next rank; in backward, the K/V block and its float32 gradient
  accumulator travel, and the last gradient hop is exposed. A message hides behind its step's kernel up to the
  device's `comm_overlap` share of it (the same rule as data-parallel traffic behind backward).
- **Ulysses** (parallel/context/ulysses.py): all-to-alls turn q, k and v from sequence shards into head shards, the
  kernel runs the whole sequence for H / (tp x C) heads, and one all-to-all turns the output back; backward runs the
  four in reverse. Nothing overlaps them (autograd runs them in line). K/V heads C does not divide are repeated to one
  per query head before they travel, as the runtime does.

Either way the rank computes 1/C of the sequence's causal attention FLOPs; everything else in the block scales with
its seq_len / C tokens (`Layout.tokens`).
"""

from __future__ import annotations

from behemoth.parallel.context.ring import ring_steps
from behemoth.planner.cluster import ClusterSpec
from behemoth.planner.layout import Layout, Workload

FLASH_BACKWARD = 2.5  # a flash kernel's backward runs five products to its forward's two (the scores recomputed)
SCORE_PASSES = (4, 7)  # materialized q x k scores: forward and backward passes over them through memory
DROPOUT_PASSES = 2.5  # a dropout kernel over the probabilities, each way: two score-sized passes and a 1-byte mask
MERGE_PASSES = 3  # the ring's online-softmax merge: the float32 accumulator read and written, the step's output read


def kernel_seconds(work: Workload, cluster: ClusterSpec, heads: float, q_len: float, k_len: float, causal: bool) -> tuple[float, float]:
    """(forward, backward) seconds of attention of `q_len` queries over `k_len` keys for `heads` query heads."""
    dev, hd, dtype = cluster.device, work.census.shape.head_dim, work.compute_dtype
    if dev.attention_kernel == "flash":
        tiles = q_len * k_len * (0.5 if causal else 1.0)
        forward = 4.0 * heads * tiles * hd / (dev.peak_rate(dtype) * dev.flash_efficiency)
        return forward, FLASH_BACKWARD * forward
    scores = heads * q_len * k_len * work.act_bytes / (dev.memory_bandwidth_gbs * 1e9)
    dropout = DROPOUT_PASSES if work.dropout > 0 else 0.0
    forward = (
        dev.gemm_seconds(dtype, q_len, k_len, hd, heads) + dev.gemm_seconds(dtype, q_len, hd, k_len, heads) + (SCORE_PASSES[0] + dropout) * scores
    )
    backward = (
        dev.gemm_seconds(dtype, q_len, k_len, hd, heads) + 3 * dev.gemm_seconds(dtype, q_len, hd, k_len, heads) + (SCORE_PASSES[1] + dropout) * scores
    )
    return forward, backward


def local_heads(work: Workload, lay: Layout) -> float:
    """Query heads of one micro-batch on one tensor-parallel rank (micro-batch x n_head / tp)."""
    return lay.micro_batch * work.census.shape.n_head / lay.tp


def attention_seconds(work: Workload, lay: Layout, cluster: ClusterSpec) -> tuple[float, float]:
    """(forward, backward) kernel seconds of one block's attention for one micro-batch on one rank (no communication):
    the whole causal sequence, or under cp the ring's steps on the busiest rank, or Ulysses' whole sequence for 1/C of
    the heads."""
    s, heads = work.seq_len, local_heads(work, lay)
    if lay.cp == 1:
        return kernel_seconds(work, cluster, heads, s, s, True)
    if lay.cp_mode == "ulysses":
        return kernel_seconds(work, cluster, heads / lay.cp, s, s, True)
    steps = ring_step_seconds(work, lay, cluster)
    return sum(f for f, _ in steps), sum(b for _, b in steps)


def ring_step_seconds(work: Workload, lay: Layout, cluster: ClusterSpec) -> list[tuple[float, float]]:
    """(forward, backward) seconds of each ring step's block kernel and merge, on the rank whose steps cost most."""
    chunk, heads, hd = work.seq_len / (2 * lay.cp), local_heads(work, lay), work.census.shape.head_dim
    bandwidth = cluster.device.memory_bandwidth_gbs * 1e9
    best: list[tuple[float, float]] = []
    for rank in range(lay.cp):
        steps = []
        for q, k, causal in ring_steps(lay.cp, rank):
            f, b = kernel_seconds(work, cluster, heads, q * chunk, k * chunk, causal)
            merge = MERGE_PASSES * 4 * heads * q * chunk * hd / bandwidth  # float32 output accumulator; backward: dq's
            steps.append((f + merge, b + merge))
        if sum(f + b for f, b in steps) > sum(f + b for f, b in best):
            best = steps
    return best


def kv_bytes(work: Workload, lay: Layout, itemsize: float) -> float:
    """Bytes of one rank's keys and values for one micro-batch (its tokens, its K/V heads of the tensor-parallel share)."""
    shape = work.census.shape
    return 2 * shape.kv_heads / lay.tp * lay.tokens(work.seq_len) * shape.head_dim * itemsize


def context_comm_seconds(work: Workload, lay: Layout, cluster: ClusterSpec) -> tuple[float, float]:
    """(forward, backward) exposed seconds of one block's context-parallel communication for one micro-batch."""
    if lay.cp == 1:
        return 0.0, 0.0
    if lay.cp_mode == "ulysses":
        return ulysses_seconds(work, lay, cluster)
    hop = lambda nbytes: cluster.collective("p2p", nbytes, lay.cp, lay.tp)  # noqa: E731
    ends = cluster.messages_cpu("p2p", lay.cp)  # a hop's send and receive, paid in line whatever the kernel hides
    kv, dkv = hop(kv_bytes(work, lay, work.act_bytes)), hop(kv_bytes(work, lay, 4))
    hides, eff = cluster.device.comm_overlap, cluster.device.block_efficiency
    steps = ring_step_seconds(work, lay, cluster)
    last = len(steps) - 1
    slow, wake = cluster.device.overlap_slowdown, cluster.wake_seconds

    def exposed(comm: float, compute: float) -> float:  # what the step's kernel does not hide, and what hiding costs it
        hidden = min(comm, hides * compute / eff)  # a hop the rank waits for wakes it (where ranks outnumber cores)
        return comm - hidden + slow * hidden + (wake if comm > hidden else 0.0)

    forward = sum(exposed(kv, f) + ends for i, (f, _) in enumerate(steps) if i < last)
    backward = dkv + wake + ends
    for i, (_, b) in enumerate(steps):
        backward += exposed((kv if i < last else 0.0) + (dkv if i > 0 else 0.0), b) + ends * ((i < last) + (i > 0))
    return forward, backward


def ulysses_seconds(work: Workload, lay: Layout, cluster: ClusterSpec) -> tuple[float, float]:
    """Ulysses' four all-to-alls of one block each way: q, k, v to head shards, the output back (backward: reversed)."""
    shape = work.census.shape
    heads, kv_heads = shape.n_head / lay.tp, shape.kv_heads / lay.tp
    per_head = lay.tokens(work.seq_len) * shape.head_dim * work.act_bytes  # one head of this rank's tokens
    a2a = lambda h: cluster.collective("all_to_all", per_head * h, lay.cp, lay.tp) + cluster.messages_cpu("all_to_all", lay.cp)  # noqa: E731
    seconds = 2 * a2a(heads) + 2 * a2a(kv_heads if kv_heads % lay.cp == 0 else heads)  # q and the output; k and v
    return seconds, seconds


def context_saved_elements(work: Workload, lay: Layout, tokens: int) -> float:
    """Elements a block saves under cp beyond what its tokens save without it: the attention output in the head-major
    layout ring and Ulysses return it in, which the output projection's input then copies (the fused kernel's output
    is already token-major: its reshape is a view)."""
    return work.census.shape.q_width / lay.tp * tokens if lay.cp > 1 else 0.0


RING_BACKWARD = (4, 10)  # a ring backward's transients: (query-sized, K-sized) tensors, ring.py's RingAttention.backward
ULYSSES_BACKWARD = 7  # query-sized tensors Ulysses' backward allocates at once (the all-to-alls' buffers, SDPA's gradients)


def context_backward_working(work: Workload, lay: Layout, tokens: int, grad_bytes: int) -> float:
    """Bytes a block's attention backward needs at its peak under cp, beyond the stash: the ring's (the float32 query
    gradient, the step's query, key and value gradients; the K/V block held and arriving, its float32 gradient
    accumulator held, arriving and being sent) or Ulysses' buffers, two hidden-size gradients; less the MLP's saved
    activations, freed by then; under ZeRO-3 plus the MLP's weight gradients, held whole until the block's unit
    reduces them (else each joins its flat buffer at once). 0 at cp=1: the fused kernel's backward is within
    `block_working`."""
    if lay.cp == 1:
        return 0.0
    shape, t = work.census.shape, lay.tp
    q, k = shape.q_width / t * tokens, shape.kv_width / t * tokens
    if lay.cp_mode == "ring":
        transients = RING_BACKWARD[0] * q * 4 + RING_BACKWARD[1] * k * 4
    else:
        transients = ULYSSES_BACKWARD * q * work.act_bytes
    attention_split = 2 * shape.q_width + 2 * shape.kv_width + shape.n_head
    mlp_saved = max(work.census.activations.split - attention_split, 0.0) / t * tokens * work.act_bytes
    hidden = 2 * shape.d_model * tokens * work.act_bytes
    mlp_grads = grad_bytes * (3 if shape.gated else 2) * shape.d_model * shape.ffn / t if lay.zero == 3 else 0.0
    return transients + hidden - mlp_saved + mlp_grads
