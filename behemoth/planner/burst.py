"""Burst parallelism (DeepPool, Park et al. MLSys'22): each layer gets only as many devices as it uses well.

At strong scaling (a fixed global batch over many devices, one or two sequences per device) data parallelism keeps
every device busy on layers too small to use it, and pays every layer's gradient all-reduce over the whole world.
A burst plan gives layer l (the embedding, each block, the head) a data-parallel degree c_l on the first c_l ranks,
chosen by a dynamic program over the layers from the planner's own per-layer costs (steptime.py):

    T[l][c] = min_c' T[l-1][c'] + transfer(c' -> c) + compute(l, c) + sync(l, c)

transfer re-shards the activations along the batch (and their gradients back), compute is the layer's forward and
backward at B / c sequences per device, and sync is its gradient all-reduce over c ranks, priced per run of
consecutive layers of one width as the runtime's buckets overlap that run's backward (so a plan of one width prices
exactly as plain data parallelism: the DP limit). A layer may use c devices only if its device-time amplification,
c x compute(l, c) / compute(l, 1), stays within a cap (default 2x): the device-seconds it saves are what a
multiplexed background job runs on. `simulate_cluster` prices the same plans over any ClusterSpec (no processes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import yaml

from behemoth.errors import BehemothError
from behemoth.planner.cluster import ClusterSpec
from behemoth.planner.comm import bucket_seconds, bytes_per, data_parallel_seconds
from behemoth.planner.compute import block_pass, embed_pass, head_pass
from behemoth.planner.cost import price
from behemoth.planner.layout import Layout, Workload
from behemoth.planner.steptime import optimizer_seconds, pass_costs

DEFAULT_AMPLIFICATION = 2.0
INF = float("inf")


def width_layout(work: Workload, width: int) -> Layout:
    """Plain data parallelism over `width` devices, the global batch split as evenly as it goes (the largest share)."""
    return Layout(dp=width, micro_batch=math.ceil(work.global_batch / width), microbatches=1)


def candidate_widths(global_batch: int, world: int) -> tuple[int, ...]:
    """Data-parallel degrees a layer may take: those up to `world` that divide the global batch (equal shares)."""
    return tuple(c for c in range(1, world + 1) if global_batch % c == 0)


@dataclass(frozen=True)
class WidthCosts:
    """Seconds of each layer's forward + backward at one width, of its backward alone, and its parameter count."""

    width: int
    train: tuple[float, ...]  # per layer: embedding, blocks, head
    backward: tuple[float, ...]
    elements: tuple[int, ...]


def core_speedup(cluster: ClusterSpec, width: int, world: int) -> float:
    """How much faster each of `width` computing ranks runs than the calibrated rate, on a node whose `world` CPU
    processes outnumber its cores: the rates were measured with every rank computing at once (a rank's share,
    cores / world), while a layer on `width` ranks leaves the others waiting, so each busy rank gets min(1, cores /
    width) cores. 1 where each rank has a device (or a core) of its own."""
    sharing = cluster.core_sharing
    return min(sharing, world / width) if sharing > 1.0 else 1.0


def width_costs(work: Workload, cluster: ClusterSpec, width: int, world: int | None = None) -> WidthCosts:
    """Per-layer costs at `width` from steptime's passes: each layer's forward, scaled so that the layers sum to
    `pass_costs`'s one-stage forward + backward (whatever backward multiplier the step-time model uses), and sped up by
    `core_speedup` where `world` ranks share fewer cores. A tied embedding's weight is counted with the head: the
    runtime sums its gradient over the wider of the two groups, which is the head's in the plans the program finds
    (the embedding is a cheap lookup)."""
    lay = width_layout(work, width)
    n = work.census.shape.n_layer
    compute, comm = block_pass(work, lay, cluster)
    forward = [embed_pass(work, lay, cluster)] + [compute + comm] * n + [head_pass(work, lay, cluster)]
    stage = pass_costs(work, lay, cluster, (0, n))
    total = stage.forward[0] + stage.backward[0] + stage.weight[0]
    scale, back = total / sum(forward), (stage.backward[0] + stage.weight[0]) / total
    scale /= core_speedup(cluster, width, world or width)
    share = work.census.at(1)
    elements = (share.embed - share.tied,) + (share.block,) * n + (share.head + share.tied,)  # a tied weight syncs with the head
    train = tuple(f * scale for f in forward)
    return WidthCosts(width, train, tuple(t * back for t in train), elements)


def layer_names(n_layer: int) -> tuple[str, ...]:
    return ("embed", *(f"block.{i}" for i in range(n_layer)), "head")


def batch_rows(batch: int, width: int, rank: int) -> tuple[int, int]:
    """Rows [start, end) of the global batch that rank `rank` of a `width`-wide group holds (empty outside it)."""
    if rank >= width:
        return (0, 0)
    return (rank * batch // width, (rank + 1) * batch // width)


def reshard_rows(batch: int, source: int, target: int, world: int) -> int:
    """The most rows any rank sends or receives when a batch split over the first `source` ranks is re-split over the
    first `target` (a rank keeps the rows it holds in both)."""
    worst = 0
    for r in range(world):
        s, t = batch_rows(batch, source, r), batch_rows(batch, target, r)
        kept = max(0, min(s[1], t[1]) - max(s[0], t[0]))
        worst = max(worst, s[1] - s[0] - kept, t[1] - t[0] - kept)
    return worst


def transfer_seconds(work: Workload, cluster: ClusterSpec, source: int, target: int, world: int) -> float:
    """Re-sharding between layers of widths `source` and `target`: the activations forward, their gradients back."""
    if source == target:
        return 0.0
    rows = reshard_rows(work.global_batch, source, target, world)
    row_bytes = work.seq_len * work.census.shape.d_model * work.act_bytes
    return 2 * cluster.link(max(source, target)).seconds("p2p", rows * row_bytes, 2)


@dataclass(frozen=True)
class BurstPlan:
    """A data-parallel degree per layer (embedding, blocks, head), each layer on the first `widths[l]` ranks."""

    widths: tuple[int, ...]
    world: int
    global_batch: int
    amplification: float = DEFAULT_AMPLIFICATION
    step_seconds: float = 0.0  # predicted
    parts: dict[str, float] = field(default_factory=dict)  # compute, transfer, sync, optimizer seconds
    device_seconds: float = 0.0  # busy device-seconds of a step (sum over layers of width x seconds)

    @property
    def names(self) -> tuple[str, ...]:
        return layer_names(len(self.widths) - 2)

    def runs(self) -> list[tuple[int, int, int]]:
        """(first layer, end layer, width) of each run of consecutive layers of one width."""
        out: list[tuple[int, int, int]] = []
        for i, c in enumerate(self.widths):
            if out and out[-1][2] == c:
                out[-1] = (out[-1][0], i + 1, c)
            else:
                out.append((i, i + 1, c))
        return out

    @property
    def idle_fraction(self) -> float:
        """Share of the world's device-seconds a step leaves idle (what multiplexing fills)."""
        return 1.0 - self.device_seconds / (self.world * self.step_seconds) if self.step_seconds else 0.0

    def describe(self) -> str:
        names = self.names
        return ", ".join(f"{names[a]}..{names[b - 1]}: {c}" if b - a > 1 else f"{names[a]}: {c}" for a, b, c in self.runs())

    def to_yaml(self) -> str:
        data = {"widths": list(self.widths), "world": self.world, "global_batch": self.global_batch, "amplification": self.amplification}
        data |= {"predicted_step_s": self.step_seconds, "idle_fraction": round(self.idle_fraction, 4)}
        return yaml.safe_dump({"burst": data}, sort_keys=False, default_flow_style=None)

    @classmethod
    def from_yaml(cls, text: str) -> BurstPlan:
        raw = (yaml.safe_load(text) or {}).get("burst")
        if not isinstance(raw, dict) or "widths" not in raw:
            raise BehemothError("the burst plan file has no burst.widths list", "write it with behemoth plan --burst --out PLAN.yaml")
        return cls(tuple(int(c) for c in raw["widths"]), int(raw["world"]), int(raw["global_batch"]), float(raw.get("amplification", 2.0)))


class BurstProblem:
    """The per-layer costs of one workload on one cluster at every candidate width, and the dynamic program over them."""

    def __init__(self, work: Workload, cluster: ClusterSpec, world: int, widths: tuple[int, ...] | None = None, *, sums: str = "layers") -> None:
        """`sums`: how gradient sums are priced: "layers", as the burst runtime overlaps them (each layer's as its
        backward ends), or "buckets", as DDP's buckets behind backward (`cost.price`'s data parallelism)."""
        if sums not in ("layers", "buckets"):
            raise BehemothError(f"burst sums={sums!r}", "use 'layers' (the burst runtime) or 'buckets' (DDP's)")
        self.sums = sums
        if world < 1 or work.global_batch < 1:
            raise BehemothError(f"a burst plan of {world} devices and global batch {work.global_batch}", "use at least one of each")
        self.work, self.cluster, self.world = work, cluster, world
        self.widths = widths or candidate_widths(work.global_batch, world)
        bad = [c for c in self.widths if c < 1 or c > world or c > work.global_batch]
        if bad:
            raise BehemothError(f"burst widths {bad} outside 1..{min(world, work.global_batch)}", "a width is at most the world and the batch")
        self.costs = {c: width_costs(work, cluster, c, world) for c in sorted(set(self.widths) | {1})}
        self.layers = len(self.costs[1].train)
        self._transfers: dict[tuple[int, int], float] = {}

    @cached_property
    def optimizer(self) -> float:
        """The optimizer step of rank 0, which every group includes: every parameter (priced once per plan)."""
        return optimizer_seconds(self.work, width_layout(self.work, 1), self.cluster, sum(self.costs[1].elements))

    def rank_optimizer(self, widths: tuple[int, ...], rank: int) -> float:
        """The optimizer step of `rank` under `widths`: over the elements of the layers at least rank + 1 wide (the
        ones it holds; a tied weight counted with the head), zero for a rank that holds none."""
        held = sum(e for e, w in zip(self.costs[1].elements, widths) if w > rank)
        return optimizer_seconds(self.work, width_layout(self.work, 1), self.cluster, held)

    def amplification(self, layer: int, width: int) -> float:
        """Device-time amplification of `layer` on `width` devices: width x its seconds there / its seconds on one."""
        return width * self.costs[width].train[layer] / self.costs[1].train[layer]

    def run_seconds(self, start: int, end: int, width: int) -> tuple[float, float]:
        """(compute, exposed sync) seconds of layers [start, end) on `width` devices."""
        cost = self.costs[width]
        compute, backward = sum(cost.train[start:end]), sum(cost.backward[start:end])
        if self.sums == "layers":
            return compute, self.layer_sums_seconds(start, end, width, backward)
        elements = sum(cost.elements[start:end])
        return compute, data_parallel_seconds(self.work, width_layout(self.work, width), self.cluster, elements, backward)

    def layer_sums_seconds(self, start: int, end: int, width: int, backward: float) -> float:
        """Exposed seconds of the burst runtime's overlapped gradient sums of a run: each layer's gradients all-reduced
        (in buckets, each paying the link's latency) as soon as its backward ends, hidden behind the run's backward up
        to the device's `comm_overlap`; the sum of the run's first layer, the last to finish, is always exposed."""
        if width == 1:
            return 0.0
        lay = width_layout(self.work, width)
        grad_bytes, bucket = bytes_per(lay, self.work)[1], self.work.bucket_mb * 2**20
        sums = [bucket_seconds(self.cluster, "all_reduce", grad_bytes * e, bucket, width, 1)[0] for e in self.costs[width].elements[start:end]]
        return max(sum(sums) - self.cluster.device.comm_overlap * backward, sums[0])

    def transfer(self, source: int, target: int) -> float:
        key = (source, target)
        if key not in self._transfers:
            self._transfers[key] = transfer_seconds(self.work, self.cluster, source, target, self.world)
        return self._transfers[key]

    def plan_of(self, widths: tuple[int, ...], amplification: float = INF) -> BurstPlan:
        """Price a given assignment (one width per layer) as the dynamic program does."""
        if len(widths) != self.layers:
            raise BehemothError(f"{len(widths)} widths for {self.layers} layers", "give the embedding, every block and the head one width each")
        plan = BurstPlan(tuple(widths), self.world, self.work.global_batch, amplification)
        compute = sync = 0.0
        for a, b, c in plan.runs():
            run = self.run_seconds(a, b, c)
            compute, sync = compute + run[0], sync + run[1]
        transfer = sum(self.transfer(widths[i - 1], widths[i]) for i in range(1, len(widths)))
        busy = sum(c * self.costs[c].train[i] for i, c in enumerate(widths))
        parts = {"compute": compute, "transfer": transfer, "sync": sync, "optimizer": self.optimizer}
        return BurstPlan(plan.widths, self.world, plan.global_batch, amplification, sum(parts.values()), parts, busy)

    def allowed(self, amplification: float) -> list[list[bool]]:
        """allowed[layer][k]: whether layer may take widths[k] under the amplification cap (one device always may)."""
        return [[c == 1 or self.amplification(i, c) <= amplification + 1e-12 for c in self.widths] for i in range(self.layers)]

    def solve(self, amplification: float = DEFAULT_AMPLIFICATION, *, uniform: bool = False) -> BurstPlan:
        """The fastest assignment under the cap: the dynamic program over layers (or, `uniform`, the best single width)."""
        if amplification < 1:
            raise BehemothError(f"--amplification {amplification} is below 1", "use 1 (no extra device time) or more (default 2)")
        ok = self.allowed(amplification)
        if uniform:
            fits = [c for k, c in enumerate(self.widths) if all(row[k] for row in ok)] or [1]
            return min((self.plan_of((c,) * self.layers, amplification) for c in fits), key=lambda p: p.step_seconds)
        return self.plan_of(self.dynamic_program(ok)[0], amplification)

    def dynamic_program(self, ok: list[list[bool]]) -> tuple[tuple[int, ...], float]:
        """The cheapest widths allowed by `ok` and their seconds (the optimizer step aside). best[end][k]: the cheapest
        layers [0, end) whose last run has width widths[k]; a run's sync is priced whole."""
        widths, n = self.widths, self.layers
        best = [[INF] * len(widths) for _ in range(n + 1)]
        back: list[list[tuple[int, int]]] = [[(-1, -1)] * len(widths) for _ in range(n + 1)]
        for k, c in enumerate(widths):
            for end in range(1, n + 1):
                for start in range(end - 1, -1, -1):
                    if not ok[start][k]:
                        break
                    run = sum(self.run_seconds(start, end, c))
                    if start == 0:
                        options = [(run, (-1, -1))]
                    else:
                        options = [(best[start][j] + self.transfer(widths[j], c) + run, (start, j)) for j in range(len(widths))]
                    cost, prev = min(options, key=lambda o: o[0])
                    if cost < best[end][k]:
                        best[end][k], back[end][k] = cost, prev
        k = min(range(len(widths)), key=lambda j: best[n][j])
        out: list[int] = []
        seconds, end = best[n][k], n
        while end > 0:
            start, j = back[end][k]
            start = max(start, 0)
            out[:0] = [widths[k]] * (end - start)
            end, k = start, j
        return tuple(out), seconds


def plain_data_parallel(work: Workload, cluster: ClusterSpec, world: int) -> float:
    """Step seconds of plain data parallelism over `world` devices, as the planner prices it (cost.price)."""
    return price(work, width_layout(work, world), cluster).step_seconds


@dataclass(frozen=True)
class ClusterPoint:
    """One strong-scaling point of the cluster simulator: data parallelism and burst, each with a multiplexed background
    job in the device time it leaves idle (data parallelism's: the exposed gradient all-reduce and optimizer step)."""

    world: int
    global_batch: int
    dp: BurstPlan  # every layer on every device: plain data parallelism with DDP's buckets (as cost.price prices it)
    burst: BurstPlan
    background_rate: float  # sequences per device-second of the background job alone on one device
    background_share: float  # of that rate, what it keeps in the foreground's idle time

    @property
    def dp_step(self) -> float:
        return self.dp.step_seconds

    @property
    def per_device_batch(self) -> float:
        return self.global_batch / self.world

    @property
    def foreground_ratio(self) -> float:
        """Burst foreground throughput over data parallelism's."""
        return self.dp_step / self.burst.step_seconds

    def background_units(self, plan: BurstPlan) -> float:
        """A background job's sequences per second in `plan`'s idle time, in units of data parallelism's foreground."""
        idle = plan.idle_fraction * self.world
        return idle * self.background_rate * self.background_share / (self.global_batch / self.dp_step)

    @property
    def cluster_throughput(self) -> float:
        """Normalized cluster throughput (data parallelism alone = 1): burst foreground plus multiplexed background."""
        return self.foreground_ratio + self.background_units(self.burst)

    @property
    def dp_multiplexed(self) -> float:
        """The same for data parallelism with a background job in its own idle time (the fair comparison)."""
        return 1.0 + self.background_units(self.dp)


def background_rate(work: Workload, cluster: ClusterSpec, micro_batch: int) -> float:
    """Sequences per second one device trains of the background job (the same model at `micro_batch`, alone)."""
    solo = Workload(work.census, work.seq_len, micro_batch, work.precision, work.param_dtype, work.bucket_mb, work.prefetch)
    return micro_batch / price(solo, width_layout(solo, 1), cluster).step_seconds


def simulate_cluster(
    work: Workload, cluster: ClusterSpec, world: int, *, amplification: float = DEFAULT_AMPLIFICATION, background_batch: int = 8, share: float = 0.5
) -> ClusterPoint:
    """Price data parallelism and the burst plan of `work` on `world` devices of `cluster`, with a background job of the
    same model at `background_batch` sequences per device keeping `share` of its solo rate in the idle device time."""
    cluster = cluster.with_nodes(world)
    problem = BurstProblem(work, cluster, world)
    plan = problem.solve(amplification)
    dp = BurstProblem(work, cluster, world, (world,), sums="buckets").plan_of((world,) * problem.layers)  # DDP, as cost.price
    return ClusterPoint(world, work.global_batch, dp, plan, background_rate(work, cluster, background_batch), share)
