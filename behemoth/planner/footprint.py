"""Memory one rank needs under a plan, in closed form: model states, ZeRO buffers, stashed activations, working set.

    peak = states + max(stash + working set + ZeRO buffers,  optimizer-step temporaries)

- **Model states** (the ZeRO paper's accounting on the rank's share): the rank holds P parameters, its pipeline
  stages' blocks (plus the embedding on the first stage, the head on the last, and a tied embedding on both) at
  1/t of each split matrix; ZeRO-0 keeps (4 + 4 + 8)P bytes, stages 1-3 shard the optimizer state, then the
  gradients, then the parameters over dp. So a layout of t x p x dp ranks holds 16Ψ/(t p) per rank before ZeRO,
  16Ψ/(t p dp) at stage 3 (the census counts the rest exactly: the embedding and head, padding of the vocabulary).
  Under expert parallelism a rank holds E / ep experts of each MoE block; dense parameters shard over dp x ep, expert
  weights over dp. Offloaded states (`Layout.offload`) are ZeRO-3's units on their tier: they count as host or disk
  bytes, not device bytes, and the device keeps the units it streams (1 + offload.prefetch blocks and a gradient).
- **ZeRO buffers**: stage 2's gradient buckets in flight, stage 3's gathered units (`memory.py` has the exact layout).
- **Stash**: what a micro-batch's forward keeps for backward on each of the rank's stages (per-token elements of a
  block from `models/activations.block_activation_elements`, the embedding's ids, the head's inputs and the loss's
  softmax), times the micro-batches the schedule holds at once on that rank (`stash_units`, the closed form of
  `simulate.peak_stash`); a recomputing rank keeps only each block's input.
- **Working set**: what exists only while a pass runs, as behemoth's runtime allocates it (measured with
  `profiler/measure.LiveBytes`): the loss's gradients over the vocabulary, a block's backward (its MLP's hidden
  gradient, the largest weight gradient before it is added to its buffer, hidden-size gradients), a recomputed
  block, the pipeline's messages (held until the step ends), and under zb-h1 the output gradients its split
  backward keeps for the weight pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from behemoth.models.chunked_loss import chunk_tokens
from behemoth.parallel.pipeline.analysis.simulate import stash_profile
from behemoth.parallel.pipeline.refusals import V_SCHEDULES
from behemoth.parallel.pipeline.schedules import build_schedule, schedule_chunks
from behemoth.parallel.zero.runtime import MAX_BUCKETS_IN_FLIGHT
from behemoth.parallel.zero.tiers import TIER_NAMES
from behemoth.planner.attention import context_backward_working, context_saved_elements
from behemoth.planner.census import TPShare
from behemoth.planner.layout import Layout, Workload, as_run
from behemoth.planner.memory import BYTES_PER_PARAM
from behemoth.planner.moe_memory import moe_backward_working, moe_saved_elements
from behemoth.planner.receives import kept_receives
from behemoth.planner.stream_memory import LISTED_VISITS, MOMENT_BYTES, UnitBytes, moments, stream_transient, synthetic_bounds
from behemoth.planner.stream_traffic import compute_bytes

STATE_BYTES_ZERO0 = (4, 4, 8)  # float32 parameters, gradients, Adam moments (replicated data parallelism)
FROZEN_PARAM_BYTES = 4  # a frozen (LoRA) base parameter: float32 on every data-parallel rank, nothing else


@dataclass
class RankMemory:
    """Bytes one pipeline rank needs, by part; `peak` is what the plan must fit."""

    rank: int
    params: float
    grads: float
    optimizer: float
    buffers: float = 0.0
    stash: float = 0.0
    working: float = 0.0
    deferred: float = 0.0  # zb-h1: the output gradients its split backward keeps until the weight pass
    optimizer_step: float = 0.0
    elements: int = 0
    host: float = 0.0  # model states offloaded to host memory (offload.*=cpu), not on the device
    disk: float = 0.0  # model states offloaded to disk (offload.*=disk)
    receives: float = 0.0  # the pipeline's kept receive buffers (resident all step; they hold every received tensor)
    streamed: float = 0.0  # a streamed pipeline stage: units, I/O jobs and activations at its worst moment (stream_memory.py)

    @property
    def states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        transient = self.streamed or self.stash + self.working + self.deferred + self.buffers
        return self.states + self.receives + max(transient, self.optimizer_step)

    def scaled(self, stash: float, deferred: float) -> float:
        """The peak of a rank like this one holding `stash` times its stashed micro-batches and `deferred` times its
        deferred gradients (ranks of one pipeline differ only in those)."""
        transient = self.stash * stash + self.working + self.deferred * deferred + self.buffers
        if self.streamed:
            transient = self.streamed + self.stash * (stash - 1) + self.deferred * (deferred - 1)
        return self.states + self.receives + max(transient, self.optimizer_step)


def rank_blocks(lay: Layout, bounds: tuple[int, ...], rank: int) -> list[tuple[int, int]]:
    """(stage, blocks) for every model stage pipeline rank `rank` holds."""
    return [(s, bounds[s + 1] - bounds[s]) for s in lay.held_stages(rank)]


def rank_elements(share: TPShare, lay: Layout, bounds: tuple[int, ...], rank: int) -> int:
    """Parameters pipeline rank `rank` holds (one tensor-parallel rank's share of them)."""
    held = rank_blocks(lay, bounds, rank)
    first = any(s == 0 for s, _ in held)
    last = any(s == lay.stages - 1 for s, _ in held)
    blocks = sum(n for _, n in held)
    return share.stage_elements(blocks, first=first, last=last, pp=lay.pp)


OFFLOAD_MOMENT_BYTES = {32: 8, 8: 2}  # Adam moments per parameter: float32, or 8-bit blocks (their scales aside)


def state_bytes(elements: float, lay: Layout, work: Workload, experts: float = 0.0) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes of `elements` parameters at the layout's ZeRO stage, wherever they live: dense
    ones sharded over dp x cp x ep, the `experts` among them over dp x cp (each ep rank holds other experts;
    `expert_data_group`). Offloaded
    states are ZeRO-3's units on their tiers (1/dp x ep of each state)."""
    z = 3 if lay.offload.streams else lay.zero
    p, g, k = STATE_BYTES_ZERO0 if z == 0 else BYTES_PER_PARAM[work.param_dtype]
    if lay.offload.enabled:
        k = OFFLOAD_MOMENT_BYTES[lay.offload.bits]
    if lay.offload.streams:  # the float32 master is the stored shard; a bf16 compute copy exists only while gathered
        p = 4
    dense = elements - experts

    def per_rank(nbytes: int, sharded_from: int) -> float:
        return nbytes * (dense / lay.shard_ranks + experts / (lay.dp * lay.cp)) if z >= sharded_from else nbytes * elements

    return per_rank(p, 3), per_rank(g, 2), per_rank(k, 1)


def placed(states: tuple[float, float, float], lay: Layout) -> dict[str, tuple[float, float, float]]:
    """The (params, grads, optimizer) bytes on each tier: device (`none`), host memory (`cpu`) and `disk`."""
    kinds, off = ("params", "grads", "optimizer"), lay.offload
    kept = [0.0 if k == "grads" and off.fused and off.tier(k) != "device" else b for k, b in zip(kinds, states)]  # fused: never stored
    return {tier: tuple(b if off.tier(k) == tier else 0.0 for k, b in zip(kinds, kept)) for tier in TIER_NAMES}  # type: ignore[misc]


def zero_buffers(share: TPShare, elements: int, lay: Layout, work: Workload, blocks: int, working: float = 0.0) -> float:
    """Stage 2's gradient buckets in flight; stage 3's gathered units (the embedding or head, or 1 + prefetch blocks);
    offloaded, the units resident on the device (1 + offload.prefetch) and one unit's gradient. On a cube the units are
    gathered in forward only: beside the stash, the larger of them and backward's `working` set is the peak's."""
    p = STATE_BYTES_ZERO0[0] if lay.zero == 0 else BYTES_PER_PARAM[work.param_dtype][0]
    if lay.offload.streams:  # gathered units and one gradient in the compute dtype (bf16: and the float32 shard kept)
        window = min(1 + lay.offload.prefetch, max(1, blocks)) * share.block
        c = BYTES_PER_PARAM[work.param_dtype][0] if lay.zero else 4
        return c * max(window, share.embed, share.head + share.tied) + (c + (4 if c != 4 else 0)) * share.block
    if lay.zero == 2:
        return min(elements * p, (MAX_BUCKETS_IN_FLIGHT + 1) * work.bucket_mb * 2**20)
    if lay.zero == 3:
        window = min(1 + work.prefetch, max(1, blocks)) * share.block
        gathered = p * max(window, share.embed, share.head + share.tied)
        return gathered if lay.regathers_units else max(0.0, gathered - working)
    return 0.0


LISTED_SCHEDULES = (*V_SCHEDULES, "1f1b-scp")  # schedules whose stash is read off their action lists, not a closed form


LISTED_ACTIONS = 6_000  # a listed schedule this short is read off its action lists; longer ones by `steady_peaks`


@lru_cache(maxsize=1024)
def schedule_peaks(name: str, p: int, m: int) -> tuple[tuple[int, int, int], ...]:
    """Per pipeline rank, at its stash's peak (the most activations held; of those points, the most weight passes
    deferred and inputs kept): (activations, deferred weight passes, kept inputs), from the schedule's own action
    lists (`simulate.stash_profile`), or for a long pipeline from their closed form."""
    v = 2 if name in V_SCHEDULES else 1
    if p * m * v * 6 > LISTED_ACTIONS and m >= 2 * p:
        return steady_peaks(name, p, m)
    return tuple(max(profile, default=(0, 0, 0)) for profile in stash_profile(build_schedule(name, p, m, v)))


def steady_peaks(name: str, p: int, m: int) -> tuple[tuple[int, int, int], ...]:
    """`schedule_peaks` in closed form for m >= 2p (tests/test_planner_schedules.py checks it against the lists): every
    ZBV rank holds 2p chunk activations at the end of its warm-up, DualPipeV's 2p + 1, both before any weight pass is
    deferred; 1f1b-scp rank r < p-1 holds two micro-batches' activations (its kept cool-down one and a recomputed one)
    and the inputs of p - r - 2 more, the last rank one."""
    if name == "zbv":
        return ((2 * p, 0, 0),) * p
    if name == "dualpipev":
        return ((2 * p + 1, 0, 0),) * p
    return tuple((2, 0, max(p - r - 2, 0)) if r < p - 1 else (1, 0, 0) for r in range(p))


def stash_units(lay: Layout, rank: int) -> int:
    """Micro-batches (interleaved: chunk passes) pipeline rank `rank` holds at once; `simulate.peak_stash` in closed form
    (for the V-shaped and shifted schedules: read off their action lists)."""
    p, m, v, r = lay.pp, lay.microbatches, lay.chunks, rank
    if p == 1:
        return 1
    if lay.schedule in LISTED_SCHEDULES:
        return schedule_peaks(lay.schedule, p, m)[r][0]
    if lay.schedule == "gpipe":
        return m
    if lay.schedule == "zb-h1" and m < p:  # a pipeline that never fills: read off the action lists (`pending_weight_passes`)
        return schedule_peaks(lay.schedule, p, m)[r][0]
    if lay.schedule in ("1f1b", "zb-h1"):  # zb-h1's input passes free the graph where 1F1B's backward does
        return min(p - r, m)
    if lay.schedule == "interleaved":
        return m * v if m == p else min(2 * (p - r - 1) + (v - 1) * p + 1, m * v)
    if lay.schedule == "chimera":
        half = m // 2
        return min(p // 2, p - r, half) + min(p // 2, r + 1, half)
    raise ValueError(f"no stash count for schedule {lay.schedule}")


def block_bytes(share: TPShare, lay: Layout, work: Workload, tokens: int) -> float:
    """What one block saves for backward for `tokens` tokens on one tensor-parallel rank (and context-parallel rank)."""
    dense = work.census.activations.elements(tokens, lay.tp, lay.seq_split)
    saved = dense + context_saved_elements(work, lay, tokens) + moe_saved_elements(work, lay, tokens)
    return saved * work.act_bytes + cube_saved_bytes(lay, work, tokens)


def cube_saved_bytes(lay: Layout, work: Workload, tokens: int) -> float:
    """A 3-D block's linears save their gathered operands for backward (`cube._Cube`, as Colossal-AI's do): each input
    q times its 1/q^3 piece (q - 1 pieces beyond the one the block's count holds) and its weight block gathered along
    T, q times the rank's piece (in the parameters' dtype)."""
    if lay.tp_mode != "3d" or lay.tp == 1:
        return 0.0
    shape, q, t = work.census.shape, lay.grid, lay.tp
    ffn = shape.ffn * (2 if shape.gated else 1)
    inputs = (2 * shape.d_model + shape.q_width + shape.ffn) * tokens / t  # qkv, fc (residual), proj, MLP proj inputs
    weights = shape.d_model * (shape.q_width + 2 * shape.kv_width + shape.q_width + ffn + shape.ffn) / t
    return (q - 1) * inputs * work.act_bytes + q * weights * BYTES_PER_PARAM[work.param_dtype][0]


def head_bytes(share: TPShare, lay: Layout, work: Workload, tokens: int) -> float:
    """The final norm's and the head's inputs and statistics, and the loss's softmax over this rank's vocabulary."""
    h, seq = work.census.shape.d_model, lay.tp if lay.seq_split else 1
    tied = work.census.shape.tied
    head_in = h * tokens / (1 if tied else seq)
    return work.act_bytes * ((h * tokens + 2 * tokens) / seq + head_in) + 4 * (share.vocab * tokens + 2 * tokens)


def embed_bytes(lay: Layout, tokens: int) -> float:
    """Token ids and positions (int64), and under tensor parallelism the vocabulary mask."""
    rows = tokens / lay.batch_blocks  # a grid (cube) rank looks up its block of the sequences
    return 8.0 * rows + (rows if lay.tp > 1 else 0)


def stage_stash(share: TPShare, lay: Layout, work: Workload, stage: int, blocks: int, recompute: bool, tokens: int) -> float:
    """Bytes one micro-batch's forward leaves on one model stage (a recomputing stage keeps each block's input only)."""
    h = work.census.shape.d_model
    per_block = h * tokens * work.act_bytes / (lay.tp if lay.seq_split else 1) if recompute else block_bytes(share, lay, work, tokens)
    out = blocks * per_block
    if stage == 0:
        out += embed_bytes(lay, tokens)
    if stage == lay.stages - 1:
        out += head_bytes(share, lay, work, tokens)
    return out


def block_working(share: TPShare, lay: Layout, work: Workload, tokens: int) -> float:
    """A block's backward: the largest weight gradient before it joins its buffer, the MLP's hidden gradient, and two
    hidden-size gradients (three without a pipeline, where the engine's loop holds one more)."""
    shape = work.census.shape
    ffn, weight = shape.ffn / lay.tp, shape.d_model * shape.ffn / lay.param_split  # the MLP weight's piece (2.5-D: 1/q^2)
    grad_bytes = 4 if lay.zero == 0 else BYTES_PER_PARAM[work.param_dtype][1]
    hidden = (2 if lay.pp > 1 else 3) / (lay.tp if lay.gridded else 1)  # a grid rank's hidden gradients are 1/tp
    out = grad_bytes * weight + (ffn + hidden * shape.d_model) * tokens * work.act_bytes
    if lay.gridded and lay.tp_mode != "3d":  # SUMMA's backward: broadcast blocks and partial products in flight
        out += SUMMA_WEIGHT_BLOCKS * grad_bytes * weight + (ffn + 2 * shape.d_model / lay.tp) * tokens * work.act_bytes
    elif lay.gridded:  # the cube's MLP backward: the gathered output gradient, dX and dW before their reduce-scatters
        out += lay.grid * (grad_bytes * weight + (ffn + shape.d_model / lay.tp) * tokens * work.act_bytes)
    return out


SUMMA_WEIGHT_BLOCKS = 2.5  # MLP weight blocks a 2-D rank's backward holds beside its gradient (measured on a 2 x 2 grid)


def loss_working(share: TPShare, lay: Layout, work: Workload, tokens: int) -> float:
    """The loss's backward over this rank's vocabulary. The plain loss: two float32 vocabulary-wide gradients, and
    without a pipeline the logits (in the compute dtype), which the engine's loop still holds. The fused one
    (models/chunked_loss.py) turns its kept logits (the stash's softmax) into their gradient in place: only the hidden
    states' gradient is new."""
    if fused_loss(share, lay, work, tokens):
        return work.act_bytes * work.census.shape.d_model * tokens
    return (8 + (work.act_bytes if lay.pp == 1 else 0)) * share.vocab * tokens


def fused_loss(share: TPShare, lay: Layout, work: Workload, tokens: int) -> bool:
    """Whether the engine computes this layout's loss fused (train.loss_chunk -1 below the chunking size; a 2-D or 3-D
    head, computed across ranks, and a head whose weight is gathered for the passes, under ZeRO-3 or streamed offload,
    stay plain)."""
    gathered = lay.zero == 3 or lay.offload.streams
    return work.loss_chunk != 0 and chunk_tokens(work.loss_chunk, tokens, share.vocab) is None and not lay.gridded and not gathered


def messages(lay: Layout, work: Workload, rank: int, stages: list[tuple[int, int]], tokens: int) -> float:
    """Pipeline messages this rank holds. The executor reaps its sends as they complete and waits for the rest at the
    end of the step; under the one-stage-per-rank schedules (1f1b, gpipe, zb-h1) measured ranks held every message
    of the step until then (one per micro-batch and direction of each held stage), under interleaved and Chimera one
    per direction."""
    if lay.pp == 1:
        return 0.0
    directions = sum((s != lay.stages - 1) + (s != 0) for s, _ in stages)
    message = message_bytes(lay, work, tokens)
    held = lay.microbatches if lay.schedule in ("1f1b", "gpipe", "zb-h1", "1f1b-scp") else 1
    return held * directions * message


def message_bytes(lay: Layout, work: Workload, tokens: int) -> float:
    """One pipeline message: a micro-batch's hidden states (or their gradient) between two stages."""
    return tokens * work.census.shape.d_model * work.act_bytes / (lay.tp if lay.seq_split else 1)


def receive_buffers(lay: Layout, work: Workload, rank: int, stages: list[tuple[int, int]], units: int, tokens: int) -> float:
    """The kept receive buffers of pipeline rank `rank` (planner/receives.py), less the received stage inputs its stash
    counts (`units` stashed micro-batches, spread over its held stages, and 1f1b-scp's kept inputs): those live in them."""
    if lay.pp == 1:
        return 0.0
    slots = kept_receives(lay.schedule, lay.pp, lay.microbatches, schedule_chunks(lay.schedule, lay.chunks), rank)
    later = sum(s != 0 for s, _ in stages) / len(stages)
    kept = schedule_peaks(lay.schedule, lay.pp, lay.microbatches)[rank][2] if lay.schedule == "1f1b-scp" and later else 0
    return max(0.0, slots - units * later - kept) * message_bytes(lay, work, tokens)


def deferred_gradients(share: TPShare, lay: Layout, work: Workload, rank: int, stages: list[tuple[int, int]], tokens: int) -> float:
    """zb-h1 and the V schedules: a micro-batch's input-gradient pass frees its graph but keeps, for the weight pass,
    each deferred linear layer's input and output gradient (parallel/deferred.py). At the rank's peak (an input pass,
    with its own graph still alive) `pending_weight_passes` earlier passes wait for their weight passes; under zb-h1
    the first stage, whose backward is not split, keeps its output's gradient for one. A V rank's pending passes are
    chunk passes: each holds one of its split stages' share (stage 0 never splits)."""
    if lay.pp == 1 or lay.schedule not in ("zb-h1", *V_SCHEDULES):
        return 0.0
    if lay.offload.streams:
        return streamed_deferred(lay, work, rank, stages, tokens)
    shape, t = work.census.shape, lay.tp
    if lay.schedule == "zb-h1" and rank == 0:
        return tokens * shape.d_model * work.act_bytes / (t if lay.seq_split else 1)
    ffn = shape.ffn * (2 if shape.gated else 1)
    grads = (shape.q_width + 2 * shape.kv_width + ffn) / t + 2 * shape.d_model
    inputs = 2 * shape.d_model / (t if lay.seq_split else 1) + (shape.q_width + shape.ffn) / t  # qkv and MLP inputs; proj inputs
    split = [(s, n) for s, n in stages if s != 0]
    per_token = sum(n * (grads + inputs) for _, n in split)
    if any(s == lay.stages - 1 for s, _ in split):
        per_token += share.vocab + shape.d_model  # the LM head's output gradient and input
    per_token /= max(1, len(split)) if lay.schedule in V_SCHEDULES else 1
    return pending_weight_passes(lay, rank) * per_token * tokens * work.act_bytes


def streamed_deferred(lay: Layout, work: Workload, rank: int, stages: list[tuple[int, int]], tokens: int) -> float:
    """A streamed stage's split backward (offload/stage_stream.py): its BI recomputes each block and keeps, until the W
    that recomputes it again, each block's input and its output's gradient (two hidden states per block, the input
    outliving the stash it was counted in), for each of the `pending_weight_passes` passes (a V rank's: chunk passes,
    each one of its split stages' share; stage 0 never splits)."""
    split = [n for s, n in stages if s != 0]
    if not split:
        return 0.0
    blocks = sum(split) / (len(split) if lay.schedule in V_SCHEDULES else 1)
    hidden = tokens * work.census.shape.d_model * work.act_bytes / (lay.tp if lay.seq_split else 1)
    return pending_weight_passes(lay, rank) * blocks * 2 * hidden


def pending_weight_passes(lay: Layout, rank: int) -> int:
    """Passes whose weight pass is still to come when pipeline rank `rank` runs an input pass: zb-h1 (rank > 0)
    min(rank, m - 1) micro-batches (the schedule's order; measured); a V schedule's chunk passes at its stash's peak, and
    zb-h1's with fewer micro-batches than stages (its peak of activations comes before any weight pass is deferred:
    at 4 stages and 2 micro-batches, 2 stashed and none deferred, where the formula added 2 and 1; measured 100.3 MiB
    on gpt-6m, 1F1B's peak)."""
    if lay.schedule in V_SCHEDULES or (lay.schedule == "zb-h1" and lay.microbatches < lay.pp):
        return schedule_peaks(lay.schedule, lay.pp, lay.microbatches)[rank][1]
    return min(rank, lay.microbatches - 1)


def kept_inputs(lay: Layout, work: Workload, rank: int, first: bool, tokens: int) -> float:
    """1f1b-scp: the inputs a recomputed micro-batch's forward keeps until its recomputation, at the rank's peak (the
    first stage's are token ids: counted with the embedding's stash)."""
    if lay.schedule != "1f1b-scp" or lay.pp == 1 or first:
        return 0.0
    kept = schedule_peaks(lay.schedule, lay.pp, lay.microbatches)[rank][2]
    return kept * tokens * work.census.shape.d_model * work.act_bytes / (lay.tp if lay.seq_split else 1)


def working_set(share: TPShare, lay: Layout, work: Workload, stages: list[tuple[int, int]], tokens: int, recomputes: bool) -> float:
    """The largest transient of the rank's passes (module docstring), per held stage."""
    grad_bytes = 4 if lay.zero == 0 else BYTES_PER_PARAM[work.param_dtype][1]
    block = max(
        block_working(share, lay, work, tokens), context_backward_working(work, lay, tokens, grad_bytes), moe_backward_working(work, lay, grad_bytes)
    )
    worst = 0.0
    for stage, _ in stages:
        if stage == lay.stages - 1:
            after_head = block - head_bytes(share, lay, work, tokens)
            need = max(loss_working(share, lay, work, tokens), after_head)
            if recomputes:
                need = max(need, after_head + block_bytes(share, lay, work, tokens))
        else:
            need = block + (block_bytes(share, lay, work, tokens) if recomputes else 0.0)
        worst = max(worst, need)
    return worst


def rank_memory(work: Workload, lay: Layout, bounds: tuple[int, ...], rank: int) -> RankMemory:
    """Every part of the memory pipeline rank `rank` needs under `lay` (any of its dp and tp ranks: they hold the same)."""
    return stage_memory(work, lay, rank, rank_blocks(lay, bounds, rank))


def stage_memory(work: Workload, lay: Layout, rank: int, stages: list[tuple[int, int]], recompute: bool | None = None) -> RankMemory:
    """`rank_memory` for a rank holding `stages`, (model stage, blocks) pairs, recomputing if `recompute` (default: if
    the layout says so): what the stage-boundary search asks."""
    lay = as_run(work, lay)
    share = work.share(lay)
    first = any(s == 0 for s, _ in stages)
    last = any(s == lay.stages - 1 for s, _ in stages)
    blocks = sum(n for _, n in stages)
    elements = share.stage_elements(blocks, first=first, last=last, pp=lay.pp)
    frozen = share.stage_frozen(blocks, first=first, last=last, pp=lay.pp)  # a LoRA base: replicated float32, no states
    trained = elements - frozen
    tiers = placed(state_bytes(trained, lay, work, blocks * share.experts), lay)
    params, grads, optimizer = tiers["device"]
    params += FROZEN_PARAM_BYTES * frozen
    tokens = lay.tokens(work.seq_len)
    recomputes = (rank in lay.recompute if recompute is None else recompute) or (lay.pp > 1 and lay.offload.streams)  # a streamed stage
    per_micro_batch = sum(stage_stash(share, lay, work, s, n, recomputes, tokens) for s, n in stages)
    if streamed_stage(lay) and last:  # a streamed last stage runs its head's forward and backward at once: nothing kept
        per_micro_batch -= head_bytes(share, lay, work, tokens)
    units = stash_units(lay, rank)
    stash = per_micro_batch * units / len(stages)  # interleaved, Chimera and V count one unit per (stage, micro-batch)
    stash += kept_inputs(lay, work, rank, first, tokens)
    opt_elements = trained / (lay.shard_ranks if lay.zero else 1) if lay.offload.tier("optimizer") == "device" else 0.0
    step = 4 * opt_elements * (2 if lay.zero and work.param_dtype != "fp32" else 1)  # foreach temporaries (+ float32 grads)
    deferred = deferred_gradients(share, lay, work, rank, stages, tokens)
    if streamed_stage(lay):
        return streamed_memory(work, lay, rank, stages, (params, grads, optimizer), stash, deferred, step, elements, tiers)
    working = working_set(share, lay, work, stages, tokens, recomputes) + messages(lay, work, rank, stages, tokens)
    return RankMemory(
        rank,
        params,
        grads,
        optimizer,
        zero_buffers(share, trained, lay, work, blocks, working),
        stash,
        working,
        deferred,
        step,
        elements,
        sum(tiers["host"]),
        sum(tiers["disk"]),
        receive_buffers(lay, work, rank, stages, units, tokens),
    )


def streamed_stage(lay: Layout) -> bool:
    """Whether each pipeline stage streams its own units (offload/stage_stream.py)."""
    return lay.pp > 1 and lay.offload.streams


def streamed_memory(
    work: Workload,
    lay: Layout,
    rank: int,
    stages: list[tuple[int, int]],
    states: tuple[float, float, float],
    stash: float,
    deferred: float,
    step: float,
    elements: int,
    tiers: dict[str, tuple[float, float, float]],
) -> RankMemory:
    """A streamed stage's memory at its worst moment (stream_memory.py): the units its visit order holds resident and
    prefetched, the deferred steps its first fetches run, beside each moment's activations (a first pass: the block's
    input and output and a forward's transient, the MLP's pre-activation and activation; later the stash, deferred
    gradients and messages, and a backward's two hidden-state gradients or the head's loss gradients)."""
    share, tokens, shape = work.share(lay), lay.tokens(work.seq_len), work.census.shape
    hidden = tokens * shape.d_model * work.act_bytes / (lay.tp if lay.seq_split else 1)
    forward = 2 * (shape.ffn / lay.tp) * tokens * work.act_bytes
    act = {"first": forward, "first:embed": hidden, "forward": forward, "backward": 0.0, "head": loss_working(share, lay, work, tokens)}
    if not any(s == 0 for s, _ in stages):  # a later stage's first fetches run while it waits for its first input
        act["first"] = 0.0
    ub = UnitBytes(
        {"embed": share.embed, "block": share.block, "head": share.head + share.tied},
        lay.shard_ranks,
        compute_bytes(lay, work),
        MOMENT_BYTES[lay.offload.bits],
        lay.offload.io_threads,
        not lay.offload.fused,
    )
    held_blocks = {s: n for s, n in stages}
    bounds = synthetic_bounds(lay.stages, held_blocks)
    m, v = lay.microbatches, schedule_chunks(lay.schedule, lay.chunks)
    if (sum(held_blocks.values()) + 2) * m * 3 > LISTED_VISITS:  # the same patterns in a shorter step
        m = min(m, 2 * lay.pp)
    units, at = stream_transient(ub, moments(lay.schedule, lay.pp, m, v, rank, bounds, lay.offload.prefetch), hidden, act)
    slots = kept_receives(lay.schedule, lay.pp, lay.microbatches, v, rank)  # what it received lives in them (not in `at`)
    params, grads, optimizer = states
    return RankMemory(
        rank,
        params,
        grads,
        optimizer,
        units,
        stash,
        max(0.0, at - stash - deferred),
        deferred,
        step,
        elements,
        sum(tiers["host"]),
        sum(tiers["disk"]),
        slots * message_bytes(lay, work, tokens),
        units + at,
    )
