"""Stage boundaries and per-stage recomputation for one layout: the inter-operator pass of the search.

For a pipeline whose ranks each hold one stage (1f1b, gpipe, zb-h1), the blocks are cut by dynamic programming over
layer costs, as Alpa's inter-operator pass does, with each stage's memory as a constraint and recomputation as a
per-stage choice: stage s with n blocks costs e_s + n c (forward, backward and weight passes of one micro-batch;
c grows by a block's forward when the stage recomputes) and needs a_s + n b_s bytes (its stash, states and working
set, from footprint.py: linear in n). Every block being the same, the smallest possible costliest stage T is found
by bisection over the finite set of values e_s + k c; the stages then take the most blocks T and memory allow,
recomputing only where they must. Schedules whose ranks hold several stages (interleaved, Chimera) get boundaries
balanced by time, and recompute on exactly the ranks that would not fit otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from behemoth.planner.cluster import ClusterSpec
from behemoth.planner.compute import block_pass, embed_pass, head_pass
from behemoth.planner.footprint import RankMemory, pending_weight_passes, stage_memory, stash_units
from behemoth.planner.layout import Layout, Workload

SINGLE_STAGE_SCHEDULES = ("1f1b", "gpipe", "zb-h1")


@dataclass(frozen=True)
class StageModel:
    """One pipeline rank's cost and memory as linear functions of its block count, without (0) and with (1) recompute."""

    extra: float  # seconds of its embedding and head passes per micro-batch
    per_block: tuple[float, float]  # seconds per block per micro-batch
    base: tuple[float, float]  # bytes at zero blocks
    slope: tuple[float, float]  # bytes per block

    def most_blocks(self, limit: float, seconds: float, rc: int) -> int:
        """The most blocks this stage can hold within `limit` bytes and `seconds` per micro-batch."""
        by_memory = math.floor((limit - self.base[rc]) / self.slope[rc] + 1e-9) if self.slope[rc] > 0 else 10**9
        by_time = math.floor((seconds - self.extra) / self.per_block[rc] + 1e-9)
        return min(by_memory, by_time)


def stage_models(work: Workload, lay: Layout, cluster: ClusterSpec, *, allow_recompute: bool) -> list[StageModel]:
    """The linear cost and memory model of every pipeline rank (each holds the stage of its own index). The first, a
    middle and the last rank are sized at one and two blocks; the others differ from the middle one only in the
    micro-batches they stash, which scale."""
    compute, comm = block_pass(work, lay, cluster)
    block = compute + comm
    per_block = (3 * block - comm, 4 * block - comm)  # forward + backward + weight; recomputing adds a forward
    embed, head = embed_pass(work, lay, cluster), head_pass(work, lay, cluster)
    p = lay.pp
    sized = {
        ref: [[stage_memory(work, lay, ref, [(ref, n)], recompute=bool(rc)) for n in (1, 2)] for rc in (0, 1)] for ref in {0, min(1, p - 1), p - 1}
    }
    models = []
    for r in range(p):
        ref = r if r in (0, p - 1) else min(1, p - 1)
        base, slope = [], []
        for rc in (0, 1):
            one, two = (scaled_peak(m, lay, r) for m in sized[ref][rc])
            base.append(one - (two - one))
            slope.append(two - one)
        if not allow_recompute:
            base[1], slope[1] = math.inf, 0.0
        extra = 3 * ((embed if r == 0 else 0.0) + (head if r == p - 1 else 0.0))
        models.append(StageModel(extra, per_block, (base[0], base[1]), (slope[0], slope[1])))
    return models


def scaled_peak(m: RankMemory, lay: Layout, rank: int) -> float:
    """The peak of pipeline rank `rank` from `m`, the memory of a rank of the same kind (first, middle or last)."""
    deferred = 1.0
    if lay.schedule == "zb-h1" and min(rank, m.rank) > 0:  # footprint.deferred_gradients
        held = pending_weight_passes(lay, m.rank)
        deferred = pending_weight_passes(lay, rank) / held if held else 0.0
    return m.scaled(stash_units(lay, rank) / stash_units(lay, m.rank), deferred)


def capacity(models: list[StageModel], limit: float, seconds: float) -> list[int]:
    """The most blocks each stage can hold within `seconds` per micro-batch, recomputing if that holds more."""
    return [max(m.most_blocks(limit, seconds, 0), m.most_blocks(limit, seconds, 1)) for m in models]


def cut_stages(models: list[StageModel], n_layer: int, limit: float) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(boundaries, recomputing ranks) minimizing the costliest stage under the memory limit; None if nothing fits.
    The costliest stage is bisected to a relative 1e-9 (the cost of a block is the resolution that matters)."""

    def feasible(t: float) -> bool:
        caps = capacity(models, limit, t)
        return min(caps) >= 1 and sum(caps) >= n_layer

    hi = max(m.extra + n_layer * max(m.per_block) for m in models)
    if not feasible(hi):
        return None
    lo = 0.0
    while hi - lo > 1e-9 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if feasible(mid) else (mid, hi)
    return assign_blocks(models, n_layer, limit, hi)


def assign_blocks(models: list[StageModel], n_layer: int, limit: float, seconds: float) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Blocks per stage within `seconds`: as many as possible without recomputing, recompute only where that is needed
    to hold enough blocks, then give back blocks from the costliest stages (most even)."""
    plain = [m.most_blocks(limit, seconds, 0) for m in models]
    rc = [m.most_blocks(limit, seconds, 1) for m in models]
    take = [max(p, 0) for p in plain]
    recompute = [p < 1 for p in plain]
    for i in sorted(range(len(models)), key=lambda i: plain[i] - rc[i]):  # the largest gains from recomputing first
        if sum(take) >= n_layer and not recompute[i]:
            continue
        if recompute[i] or rc[i] > take[i]:
            recompute[i], take[i] = True, rc[i]
    while sum(take) > n_layer:
        cost = [m.extra + t * m.per_block[int(r)] for m, t, r in zip(models, take, recompute)]
        i = max((j for j in range(len(take)) if take[j] > 1), key=lambda j: (cost[j], j))
        take[i] -= 1
        if recompute[i] and take[i] <= plain[i]:
            recompute[i] = False
    bounds = [0]
    for t in take:
        bounds.append(bounds[-1] + t)
    return tuple(bounds), tuple(i for i, r in enumerate(recompute) if r)
