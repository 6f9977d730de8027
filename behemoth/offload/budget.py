"""How much memory a streamed step needs, and the prefetch depth that fits a budget (pure: sizes in, bytes out).

Bytes a rank holds at the worst moment of a step, on the compute device:

- states kept in memory: every shard whose tier is device memory (`device`, and `host` on a CPU-only machine);
- the resident units of one action (the head with a tied embedding is two): full flat parameters, their
  gradient and, over several ranks, this rank's shard kept for the step;
- prefetched stays: a parameter shard each (and a waiting gradient shard);
- background jobs in flight: an optimizer step holds a parameter, gradient and state shard and Adam's
  temporaries (two float32 moments' worth; the 8-bit kernel works on dequantized moments);
- activations: every block's input for every micro-batch (kept at block boundaries), one boundary's
  gradients, one block recomputed with its backward, and the head's logits and their gradient.

The runtime and `behemoth estimate` both use this model; the tests measure the resident set against it.
"""

from __future__ import annotations

from dataclasses import dataclass

from behemoth.errors import BehemothError
from behemoth.offload.order import make_order, plan_residencies, stores_grads
from behemoth.offload.policy import OffloadPolicy
from behemoth.parallel.zero.adam import CHUNK, shard_pieces, state_bytes
from behemoth.parallel.zero.layout import FlatLayout
from behemoth.parallel.zero.tiers import in_device_memory

F32 = 4


@dataclass(frozen=True)
class UnitSize:
    """One unit on one rank: elements of its full flat parameters and of this rank's shard, bytes of its optimizer state."""

    full: int
    shard: int
    state_bytes: int
    frozen: bool = False  # a frozen base's unit (LoRA): no gradient, no step


@dataclass(frozen=True)
class ActivationShape:
    """What the activations of a step depend on (per rank)."""

    micro_batch: int
    seq_len: int
    d_model: int
    ffn: int
    vocab: int
    n_layer: int
    microbatches: int


def activation_bytes(a: ActivationShape) -> int:
    """Block inputs of every micro-batch, one boundary's gradients, one block's recomputation and the head's logits."""
    token = a.micro_batch * a.seq_len
    boundaries = (a.n_layer + 1) * a.microbatches * token * a.d_model * F32
    grads = a.microbatches * token * a.d_model * F32
    block = 2 * token * (8 * a.d_model + 2 * a.ffn) * F32  # saved tensors and their gradients during one backward
    head = 3 * token * a.vocab * F32  # logits, their float32 copy in the loss, their gradient
    return boundaries + grads + block + head


def job_bytes(u: UnitSize) -> int:
    """An optimizer step running: parameter, gradient and state shards, and Adam's temporaries (it steps at most CHUNK
    elements at once; the 8-bit kernel dequantizes both moments and copies the gradient: four float32 chunks)."""
    return 0 if u.frozen else u.shard * F32 * 2 + u.state_bytes + 4 * min(u.shard, CHUNK) * F32


def queued_bytes(u: UnitSize) -> int:
    """A step waiting for an I/O thread: its parameter and gradient shards."""
    return 0 if u.frozen else u.shard * F32 * 2


@dataclass(frozen=True)
class MemoryPeak:
    """The parts of a step's peak on one rank, in bytes."""

    in_memory_states: int
    resident: int
    prefetched: int
    jobs: int
    activations: int

    @property
    def total(self) -> int:
        return self.in_memory_states + self.resident + self.prefetched + self.jobs + self.activations


def peak_bytes(
    units: list[UnitSize],
    act: ActivationShape,
    *,
    prefetch: int,
    in_flight: int,
    sharded: bool,
    in_memory_states: int = 0,
    tied: bool = False,
    io_threads: int = 2,
) -> MemoryPeak:
    """The step's peak: see the module docstring. `sharded`: more than one data-parallel rank (a shard is kept apart);
    of `in_flight` jobs, `io_threads` run and the others wait with their inputs."""
    per_unit = [u.full * F32 * (1 if u.frozen else 2) + (u.shard * F32 if sharded else 0) for u in units]
    resident = max(per_unit, default=0) + (per_unit[0] if tied and units else 0)
    largest_shard = max((u.shard for u in units), default=0)
    prefetched = prefetch * largest_shard * F32 * (1 if units and all(u.frozen for u in units) else 2)
    running = min(in_flight, io_threads)
    jobs = running * max((job_bytes(u) for u in units), default=0) + (in_flight - running) * max((queued_bytes(u) for u in units), default=0)
    return MemoryPeak(in_memory_states, resident, prefetched, jobs, activation_bytes(act))


def fit_prefetch(
    units: list[UnitSize],
    act: ActivationShape,
    budget: float,
    *,
    prefetch: int,
    io_threads: int,
    sharded: bool,
    in_memory_states: int = 0,
    tied: bool = False,
) -> tuple[int, int, MemoryPeak] | None:
    """The deepest prefetch (at most the asked one) and the jobs in flight whose peak fits `budget` bytes; None when even
    no prefetch and one job do not fit (the budget is smaller than one unit plus activations)."""
    for depth in range(prefetch, -1, -1):
        for in_flight in range(depth + io_threads + 1, 0, -1):
            peak = peak_bytes(
                units, act, prefetch=depth, in_flight=in_flight, sharded=sharded, in_memory_states=in_memory_states, tied=tied, io_threads=io_threads
            )
            if peak.total <= budget:
                return depth, in_flight, peak
    return None


def unit_sizes(layouts: list[FlatLayout], rank: int, bits: int, frozen: list[bool] | None = None) -> list[UnitSize]:
    """Each unit's size on `rank` from its flat layout (the optimizer's state from its bits; a frozen unit has none)."""
    out = []
    for i, lay in enumerate(layouts):
        still = bool(frozen and frozen[i])
        out.append(UnitSize(lay.padded, lay.shard_size, 0 if still else state_bytes(shard_pieces(lay, rank), lay.shard_size, bits), still))
    return out


def in_memory_state_bytes(units: list[UnitSize], tiers: dict[str, str], device_type: str, *, grads_stored: bool) -> int:
    """Bytes of the states whose tier is device memory (`tiers`: kind -> tier name; the gradient tier only if used)."""
    total = 0
    if in_device_memory(tiers["params"], device_type):
        total += sum(u.shard * F32 for u in units)
    if grads_stored and in_device_memory(tiers["grads"], device_type):
        total += sum(u.shard * F32 for u in units if not u.frozen)
    if in_device_memory(tiers["optimizer"], device_type):
        total += sum(u.state_bytes for u in units)
    return total


def fit_budget(
    policy: OffloadPolicy,
    layouts: list[FlatLayout],
    rank: int,
    act: ActivationShape,
    *,
    device_type: str,
    tied: bool,
    frozen: list[bool] | None = None,
) -> tuple[int, int, MemoryPeak]:
    """(prefetch depth, jobs in flight, peak) for the policy within its budget (`frozen`: which units are a frozen
    base's, with no gradient or step); a one-line refusal when nothing fits."""
    sizes = unit_sizes(layouts, rank, policy.bits, frozen)
    plan = plan_residencies(make_order(policy.order, act.n_layer, act.microbatches), {len(layouts) - 1: (0,)} if tied else {})
    held = in_memory_state_bytes(sizes, policy.tiers, device_type, grads_stored=stores_grads(plan, deferred=not policy.fused))
    sharded = layouts[0].world > 1 if layouts else False
    unbounded = peak_bytes(
        sizes,
        act,
        prefetch=policy.prefetch,
        in_flight=policy.prefetch + policy.io_threads + 1,
        sharded=sharded,
        in_memory_states=held,
        tied=tied,
        io_threads=policy.io_threads,
    )
    if policy.max_memory_bytes is None:
        return policy.prefetch, policy.prefetch + policy.io_threads + 1, unbounded
    fit = fit_prefetch(
        sizes, act, policy.max_memory_bytes, prefetch=policy.prefetch, io_threads=policy.io_threads, sharded=sharded, in_memory_states=held, tied=tied
    )
    if fit is None:
        least = peak_bytes(sizes, act, prefetch=0, in_flight=1, sharded=sharded, in_memory_states=held, tied=tied, io_threads=1)
        mib = 2**20
        raise BehemothError(
            f"offload.max_memory_gb={policy.max_memory_bytes / 2**30:g} is smaller than one unit plus activations: "
            f"{least.total / mib:.1f} MiB at least (largest unit {least.resident / mib:.1f} + its step "
            f"{least.jobs / mib:.1f} + activations {least.activations / mib:.1f} + states kept in memory "
            f"{least.in_memory_states / mib:.1f} MiB)",
            "raise offload.max_memory_gb, put more states on disk, shorten train.micro_batch, or split layers with parallel.tp",
        )
    return fit


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def return_freed_memory(threshold: int = 2**20) -> bool:
    """glibc: give every allocation of `threshold` bytes or more its own mapping, unmapped when freed.

    The runtime allocates and frees unit-sized buffers all the time, on several threads; glibc's adaptive threshold
    would soon serve them from its heaps (one per thread), which keep freed memory, so the resident set would grow
    past the budget with memory nobody uses. On a GPU the caching allocator owns device memory and this is moot.
    """
    import ctypes

    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
