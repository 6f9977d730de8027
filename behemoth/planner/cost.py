"""The price of one plan: memory per rank and step time on a cluster, tokens per second, MFU, and what binds.

`price(work, layout, cluster)` is the planner's cost model in one call (footprint.py for memory, steptime.py for
time); the search calls it for every candidate, with the pipeline's closed form, and `price_ranking` prices every
row it reports by one function: the schedule simulator for every pipelined row (fed by the same per-pass costs) when
all of them are small enough to simulate, else the closed form for all.
"""

from __future__ import annotations

from dataclasses import dataclass

from behemoth.models.shape import hardware_flops_per_token, layer_flops
from behemoth.planner.cluster import ClusterSpec
from behemoth.planner.footprint import RankMemory, rank_memory
from behemoth.planner.layout import Layout, Workload
from behemoth.planner.pipetime import runtime_bounds, scp_share, uniform_bounds
from behemoth.planner.steptime import StepTime, step_time

GiB = 2**30
TIGHT_MEMORY = 0.9  # a plan whose busiest rank uses more than this share of the device is memory-bound
SIMULATE_LIMIT = 40_000  # actions (ranks x micro-batches x chunks x ~6): larger pipelines keep the closed form


@dataclass
class PlanCost:
    """Predicted memory of every pipeline rank and the step time of one plan."""

    layout: Layout
    bounds: tuple[int, ...]
    memory: list[RankMemory]
    time: StepTime
    limit: float  # usable bytes per device
    model_flops: float  # per step, the MFU count
    hardware_flops: float  # per step, with recomputation
    peak_flops: float  # per device, for the compute dtype

    @property
    def peak_memory(self) -> float:
        return max(m.peak for m in self.memory)

    @property
    def busiest(self) -> RankMemory:
        return max(self.memory, key=lambda m: m.peak)

    @property
    def fits(self) -> bool:
        return self.peak_memory <= self.limit

    @property
    def step_seconds(self) -> float:
        return self.time.total

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.time.total

    @property
    def tokens(self) -> float:
        return self.model_flops / self.flops_per_token

    flops_per_token: float = 1.0

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.time.total * self.layout.world * self.peak_flops)

    @property
    def hfu(self) -> float:
        return self.hardware_flops / (self.time.total * self.layout.world * self.peak_flops)

    def shares(self) -> dict[str, float]:
        """Where the step's time goes, as fractions: compute, the pipeline's idle time (its bubble and the waits for its
        messages), recomputation, tensor- and data-parallel traffic, the optimizer step."""
        t = self.time
        total = t.total
        compute = t.passes - t.bubble - t.tp_comm - t.recompute - t.cp_comm
        return {
            "compute": max(compute, 0.0) / total,
            "bubble": t.bubble / total,
            "recompute": t.recompute / total,
            "tp_comm": t.tp_comm / total,
            "dp_comm": t.dp_comm / total,
            "optimizer": t.optimizer / total,
            "ep_comm": t.ep_comm / total,
            "offload": t.offload / total,
            "cp_comm": t.cp_comm / total,
        }

    def binding(self, cluster: ClusterSpec) -> str:
        """What limits this plan: memory when the busiest rank is near full, else the largest cost besides compute."""
        busiest = self.busiest
        if self.peak_memory > TIGHT_MEMORY * self.limit:
            return f"memory (pp rank {busiest.rank}: {self.peak_memory / GiB:.1f} of {self.limit / GiB:.1f} GiB)"
        shares = self.shares()
        name, share = max(((k, v) for k, v in shares.items() if k != "compute"), key=lambda kv: kv[1])
        if share < 0.05:
            return "compute"
        lay = self.layout
        span = {"tp_comm": lay.tp, "dp_comm": lay.tp * lay.shard_ranks, "ep_comm": lay.tp * lay.ep, "cp_comm": lay.tp * lay.cp}.get(name)
        where = "" if span is None else (" (intra-node link)" if cluster.link(span) is cluster.intra_node else " (inter-node link)")
        label = {
            "tp_comm": "tensor-parallel traffic",
            "dp_comm": "data-parallel traffic",
            "bubble": "pipeline bubble",
            "recompute": "recomputation",
            "optimizer": "optimizer step",
            "ep_comm": "expert all-to-all",
            "offload": "offload traffic",
            "cp_comm": "context-parallel traffic",
        }[name]
        return f"{label}{where} {share:.0%}"


def resolve_bounds(work: Workload, lay: Layout) -> tuple[int, ...]:
    """The layout's stage boundaries, or the runtime's FLOP-balanced ones when it leaves them unset."""
    if lay.boundaries is not None:
        return lay.boundaries
    n = work.census.shape.n_layer
    if lay.stages == 1:
        return (0, n)
    return runtime_bounds(layer_flops(work.census.shape, work.seq_len), lay.stages)


def planned_bounds(work: Workload, lay: Layout) -> tuple[int, ...]:
    """Boundaries the planner writes into a plan: equal blocks balanced against the embedding's and head's FLOPs."""
    costs = layer_flops(work.census.shape, work.seq_len)
    return uniform_bounds(costs.embed, costs.blocks[0], costs.head, len(costs.blocks), lay.stages)


def probe_ranks(pp: int) -> list[int]:
    """The pipeline ranks whose memory can be the largest under any schedule: the ends (most stashed, or the embedding
    and head), their neighbours and the middle (Chimera)."""
    return sorted({r for r in (0, 1, pp // 2 - 1, pp // 2, pp - 2, pp - 1) if 0 <= r < pp})


def price(work: Workload, lay: Layout, cluster: ClusterSpec, *, exact: bool = False, every_rank: bool = True) -> PlanCost:
    """Memory per pipeline rank (every one, or the probe ranks while searching) and step time of `lay` on `cluster`."""
    bounds = resolve_bounds(work, lay)
    memory = [rank_memory(work, lay, bounds, r) for r in (range(lay.pp) if every_rank else probe_ranks(lay.pp))]
    time = step_time(work, lay, cluster, bounds, exact=exact)
    census, tokens = work.census, work.tokens_per_step
    per_token = census.flops_per_token(work.seq_len)
    recomputed: float = sum(bounds[s + 1] - bounds[s] for r in lay.recompute for s in lay.held_stages(r)) if lay.recompute else 0
    if lay.schedule == "1f1b-scp" and lay.pp > 1:  # blocks rerun per micro-batch, on average
        recomputed += sum((bounds[r + 1] - bounds[r]) * scp_share(lay, r) for r in range(lay.pp))
    hardware = hardware_flops_per_token(census.shape, census.matmul_params, work.seq_len, recomputed)
    peak = cluster.device.peak(work.compute_dtype)
    return PlanCost(lay, bounds, memory, time, cluster.device.usable_bytes, per_token * tokens, hardware * tokens, peak, per_token)


def simulable(lay: Layout) -> bool:
    """Whether the schedule simulator prices `lay` quickly enough for a ranking (a pipeline of bounded actions)."""
    return lay.pp == 1 or lay.pp * lay.microbatches * max(1, lay.chunks) * 6 <= SIMULATE_LIMIT


def price_ranking(work: Workload, costs: list[PlanCost], cluster: ClusterSpec, *, simulate: bool = True) -> list[PlanCost]:
    """Every row of a ranking priced again by one function (same bounds and recomputation): with the simulator for every
    pipelined row when `simulate` and all can be simulated, else with the closed form for every row."""
    exact = simulate and all(simulable(c.layout) for c in costs)
    return [price(work, c.layout.but(boundaries=c.bounds), cluster, exact=exact) for c in costs]
