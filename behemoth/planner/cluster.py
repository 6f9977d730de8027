"""The hardware a plan runs on, as a value: `ClusterSpec`, read from and written to YAML.

A cluster is `nodes` machines of `devices_per_node` identical devices. The cost model needs, per device, its memory,
its matrix-multiply rate by dtype (a peak and, where measured, a curve by matrix size), its memory bandwidth and the
fixed cost of launching one operator; per link (within a node, between nodes), the latency and bus bandwidth of
each collective (nccl-tests' convention: an all-reduce of B bytes over n ranks moves 2(n-1)/n B per rank at the bus
bandwidth; all-gather and reduce-scatter (n-1)/n B; all-to-all (n-1)/n B; a p2p transfer B); and the host's memory
and disk bandwidth. `behemoth calibrate` measures all of it on this machine and writes one; named presets
(planner/clusters/*.yaml) describe common GPU servers with the vendor figures cited in the file.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from behemoth.errors import BehemothError

PRESET_DIR = Path(__file__).parent / "clusters"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
# Messages a rank sends plus receives in one collective, per other rank of the group (a ring's all-gather and
# reduce-scatter n - 1 each way, an all-reduce twice that, a pairwise all-to-all one each way with every other rank);
# a point-to-point step of a ring (context parallelism's hop, a SUMMA broadcast's step) one send and one receive.
MESSAGE_ENDS = {"all_reduce": 4, "all_gather": 2, "reduce_scatter": 2, "all_to_all": 2}
GB = 1e9


class Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LinkSpec(Spec):
    """One kind of link: an alpha-beta cost per collective. alpha = `latency_us` plus `hop_latency_us` per step of the
    algorithm (a ring's n - 1 steps for all-gather, reduce-scatter and all-to-all; a tree's 2 log2 n for all-reduce);
    beta = bus bandwidth, reached in full only by large messages: each step's chunk (the tensor / n) moves at
    `bandwidth_gbs` x chunk / (chunk + `half_bytes`). Measured `ops` (from `behemoth calibrate`, at the ring size
    it ran) replace the formula for their op; `group_ops`, measured on smaller groups of the same machine running at
    once (as a job's tensor- or data-parallel groups do), replace `ops` for groups nearer their size."""

    latency_us: float = Field(..., ge=0, description="fixed cost of one collective or transfer")
    bandwidth_gbs: float = Field(..., gt=0, description="bus bandwidth, GB/s per device (10^9 bytes)")
    hop_latency_us: float = Field(0.0, ge=0, description="latency each step of a ring or tree adds")
    half_bytes: float = Field(0.0, ge=0, description="chunk size (bytes per step) at which half the bus bandwidth is reached")
    ops: dict[str, tuple[float, float]] = Field(default_factory=dict, description="op -> (latency_us, bandwidth_gbs), measured")
    group_ops: dict[int, dict[str, tuple[float, float]]] = Field(
        default_factory=dict,
        description="group size -> op -> (latency_us, bandwidth_gbs), measured on groups of that size running at once "
        "(`behemoth calibrate` with 4 or more processes: pairs and the whole world)",
    )

    def measured(self, op: str, ranks: int) -> tuple[float, float] | None:
        """(latency us, bus GB/s) of `op` measured on the group size nearest `ranks` (by factor; the larger on a tie),
        else `ops`' (None where neither measured it)."""
        sizes = [n for n, ops in self.group_ops.items() if op in ops]
        if not sizes:
            return self.ops.get(op)
        return self.group_ops[min(sizes, key=lambda n: (abs(math.log2(n / max(ranks, 2))), -n))][op]

    def seconds(self, op: str, nbytes: float, ranks: int, rails: float = 1.0) -> float:
        """Time of one `op` of `nbytes` (the full tensor) over `ranks` devices on this link; `rails`: how many of these
        links each node's share of the group drives at once (a group with 8 devices per node crosses nodes on 8 NICs)."""
        if ranks <= 1 and op != "p2p":
            return 0.0
        found = self.measured(op, ranks)
        if found is not None:
            latency, bandwidth = found
            return latency * 1e-6 + nbytes * bus_factor(op, ranks) / (bandwidth * GB)
        chunk = nbytes if op == "p2p" else nbytes / ranks
        efficiency = chunk / (chunk + self.half_bytes) if self.half_bytes else 1.0
        alpha = (self.latency_us + self.hop_latency_us * algorithm_steps(op, ranks)) * 1e-6
        return alpha + nbytes * bus_factor(op, ranks) / (self.bandwidth_gbs * rails * efficiency * GB)


def algorithm_steps(op: str, ranks: int) -> int:
    """Latency-bound steps of one collective: NCCL's ring for gathers, scatters and all-to-all, its tree (or the ring,
    whichever is shorter) for all-reduce, one for a transfer."""
    if op == "p2p":
        return 1
    if op == "all_reduce":
        return min(2 * (ranks - 1), 2 * math.ceil(math.log2(max(ranks, 2))))
    return ranks - 1


def bus_factor(op: str, ranks: int) -> float:
    """Bytes each device moves per byte of the full tensor (nccl-tests' bus bandwidth convention)."""
    if op == "p2p":
        return 1.0
    share = (ranks - 1) / ranks
    return 2 * share if op == "all_reduce" else share


class GemmCurve(Spec):
    """Achieved share of peak of an (m, n, k) matrix product: `ceiling` x f(m) x f(n) x f(k), f(x) = x / (x + `half`).
    Rises monotonically in every dimension (tiles fill the device, the k loop amortizes its prologue), tends to
    `ceiling` as all grow and to 0 as any shrinks; the device's memory bandwidth bounds it from above as well."""

    ceiling: float = Field(..., gt=0, le=1, description="share of peak the largest products reach")
    half: float = Field(..., gt=0, description="the dimension at which that dimension's factor is one half")
    source: str = Field("", description="the measurements the two numbers were fitted to")

    def efficiency(self, m: float, n: float, k: float) -> float:
        h = self.half
        return self.ceiling * (m / (m + h)) * (n / (n + h)) * (k / (k + h))


def fit_gemm(points: Sequence[tuple[float, float, float, float]], *, source: str = "") -> GemmCurve:
    """The curve closest (least squares in log efficiency) to measured (m, n, k, share of peak) points: a grid over
    `half`, the best `ceiling` for each in closed form (the geometric mean of the ratios)."""
    if not points:
        raise BehemothError("no matrix-product measurements to fit a curve to", "measure some with behemoth calibrate")
    best: tuple[float, float, float] | None = None
    for i in range(121):
        half = 2 ** (1 + i * 0.1)  # 2 .. 8192
        shape = [math.log(m / (m + half) * n / (n + half) * k / (k + half)) for m, n, k, _ in points]
        logs = [math.log(max(e, 1e-6)) for *_, e in points]
        c = min(0.0, sum(lg - sh for lg, sh in zip(logs, shape)) / len(points))
        err = sum((lg - sh - c) ** 2 for lg, sh in zip(logs, shape))
        if best is None or err < best[0]:
            best = (err, half, math.exp(c))
    assert best is not None
    return GemmCurve(ceiling=min(1.0, best[2]), half=best[1], source=source)


class AdamWRate(Spec):
    """What one AdamW step (torch's kernel for the device, as training picks it) costs a rank: a fixed part and a
    part per parameter element it steps, fitted to two measured sizes."""

    fixed_us: float = Field(..., ge=0, description="microseconds of a step whatever its size (launches, the Python loop)")
    ns_per_element: float = Field(..., gt=0, description="nanoseconds per stepped parameter element")

    def seconds(self, elements: float) -> float:
        """A step over `elements` (zero when the rank steps nothing)."""
        return self.fixed_us * 1e-6 + self.ns_per_element * 1e-9 * elements if elements > 0 else 0.0


class DeviceSpec(Spec):
    """One accelerator (or, on a CPU-only machine, one process's share of the CPUs)."""

    name: str
    memory_gb: float = Field(..., gt=0, description="memory per device, GB (10^9 bytes)")
    reserved_gb: float = Field(0.0, ge=0, description="memory the runtime keeps for itself (CUDA context, allocator slack)")
    peak_tflops: dict[str, float] = Field(..., description="dense matrix-multiply peak by dtype (fp32, tf32, bf16)")
    matmul_efficiency: list[tuple[int, float]] = Field(
        default_factory=lambda: [(256, 0.25), (1024, 0.6), (4096, 0.8), (16384, 0.85)],
        description="(square matrix size n, achieved fraction of peak): the curve the compute time interpolates",
    )
    matmul_tflops: dict[str, list[tuple[int, float]]] = Field(default_factory=dict, description="measured (n, TFLOP/s) by dtype")
    gemm: GemmCurve | None = Field(None, description="share of peak by (m, n, k); default: fitted to matmul_tflops or matmul_efficiency")
    attention_kernel: Literal["flash", "materialized"] = Field(
        "materialized", description="flash: scores never leave on-chip memory; materialized: s x s scores written and read"
    )
    flash_efficiency: float = Field(0.5, gt=0, le=1, description="share of peak a flash-attention kernel reaches (forward and backward)")
    elementwise: Literal["fused", "eager"] = Field(
        "fused", description="fused: saved activations written and read once more; eager: every operator through memory (planner/elementwise.py)"
    )
    _curves: dict[str, GemmCurve] = PrivateAttr(default_factory=dict)
    memory_bandwidth_gbs: float = Field(..., gt=0, description="device memory bandwidth, GB/s")
    op_overhead_us: float = Field(5.0, ge=0, description="fixed cost of launching one operator")
    async_launch: bool = Field(
        False,
        description="the host queues kernels ahead of the device (CUDA streams), so a pass costs the larger of its kernels' "
        "and its launches' seconds, not their sum; False where operators run on the host that issues them (a CPU)",
    )
    adamw: AdamWRate | None = Field(None, description="measured AdamW step cost (behemoth calibrate); None: priced from memory bandwidth")
    sustained_clock: float = Field(
        1.0,
        gt=0,
        le=1,
        description="share of the rated (boost-clock) rate the device sustains through a training step's kernels; 1 for a "
        "calibration (its rates are measured); a preset states where its figure comes from",
    )
    sustained_source: str = Field("", description="where `sustained_clock` comes from (a fit: its rows and command)")
    block_efficiency: float = Field(
        1.0,
        gt=0,
        le=1,
        description="measured residual: a block's priced seconds (products, attention, elementwise, launches) over its measured ones",
    )
    comm_overlap: float = Field(
        0.9,
        ge=0,
        le=1,
        description="share of a collective that can hide behind computation (GPUs: NCCL beside the kernels; CPUs whose cores all compute: little)",
    )
    overlap_slowdown: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="share of its rate computation loses while a collective runs beside it (NCCL's blocks hold SMs and memory bandwidth)",
    )

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gb - self.reserved_gb) * GB

    def peak(self, dtype: str) -> float:
        """FLOP/s the device is rated at for `dtype` (its peak, or the best measured), the denominator of MFU."""
        rated = self.peak_tflops.get(dtype)
        if rated is None and self.matmul_tflops.get(dtype):
            rated = max(v for _, v in self.matmul_tflops[dtype])
        return (rated or self.peak_tflops["fp32"]) * 1e12

    def matmul_rate(self, dtype: str, n: float) -> float:
        """FLOP/s of a matrix product of typical dimension `n` in `dtype` (measured curve, else peak x efficiency)."""
        curve = self.matmul_tflops.get(dtype)
        if curve:
            return interpolate(curve, n) * 1e12
        peak = self.peak_tflops.get(dtype) or self.peak_tflops.get("fp32")
        if peak is None:
            raise BehemothError(f"device {self.name} lists no peak_tflops for {dtype} or fp32", "add peak_tflops.fp32 to the cluster file")
        return peak * interpolate(self.matmul_efficiency, n) * 1e12

    def gemm_curve(self, dtype: str) -> GemmCurve:
        """The (m, n, k) curve: stated, else fitted to this dtype's measured squares, else to `matmul_efficiency`."""
        if self.gemm is not None:
            return self.gemm
        if dtype not in self._curves:
            self._curves[dtype] = _fitted_curve(self, dtype)
        return self._curves[dtype]

    def gemm_seconds(self, dtype: str, m: float, n: float, k: float, batch: float = 1.0) -> float:
        """Seconds of `batch` (m x k) @ (k x n) products: the slower of their FLOPs at the curve's rate and their
        operands' bytes at the memory bandwidth."""
        if min(m, n, k, batch) <= 0:
            return 0.0
        flops = 2.0 * batch * m * n * k
        compute = flops / (self.peak_rate(dtype) * self.gemm_curve(dtype).efficiency(m, n, k))
        memory = batch * (m * k + k * n + m * n) * DTYPE_BYTES.get(dtype, 4) / (self.memory_bandwidth_gbs * GB)
        return max(compute, memory)

    def issued(self, kernels: float, ops: float) -> float:
        """Seconds of `ops` operators whose kernels take `kernels` seconds: launches and kernels in sequence on a host
        that runs them itself; on an asynchronous device the launches are issued while earlier kernels run, so only
        what the launches take beyond the kernels is exposed."""
        launches = ops * self.op_overhead_us * 1e-6
        return max(kernels, launches) if self.async_launch else kernels + launches

    def peak_rate(self, dtype: str) -> float:
        """FLOP/s the curve's shares are of while training: the rated rate at the sustained clock."""
        return self.rated_rate(dtype) * self.sustained_clock

    def rated_rate(self, dtype: str) -> float:
        """FLOP/s the device is rated at: the rated peak, or the best measured when none is rated."""
        rated = self.peak_tflops.get(dtype)
        if rated is None and self.matmul_tflops.get(dtype):
            rated = max(v for _, v in self.matmul_tflops[dtype])
        rated = rated or self.peak_tflops.get("fp32")
        if rated is None:
            raise BehemothError(f"device {self.name} lists no peak_tflops for {dtype} or fp32", "add peak_tflops.fp32 to the cluster file")
        return rated * 1e12


DTYPE_BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}


def _fitted_curve(device: DeviceSpec, dtype: str) -> GemmCurve:
    measured = device.matmul_tflops.get(dtype)
    peak = device.rated_rate(dtype) / 1e12
    if measured:
        points = [(n, n, n, v / peak) for n, v in measured]
        return fit_gemm(points, source=f"fitted to the measured {dtype} squares")
    points = [(n, n, n, e) for n, e in device.matmul_efficiency]
    return fit_gemm(points, source="fitted to matmul_efficiency")


def interpolate(curve: list[tuple[int, float]], n: float) -> float:
    """Piecewise-linear in log n between measured points, constant beyond the ends."""
    points = sorted(curve)
    sizes = [p[0] for p in points]
    i = bisect.bisect_left(sizes, n)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (n0, v0), (n1, v1) = points[i - 1], points[i]
    w = (math.log(n) - math.log(n0)) / (math.log(n1) - math.log(n0))
    return v0 + w * (v1 - v0)


class HostSpec(Spec):
    memory_gb: float = Field(..., gt=0, description="host memory per node, GB")
    memory_bandwidth_gbs: float = Field(..., gt=0, description="host memory bandwidth per node, GB/s")
    disk_bandwidth_gbs: float = Field(..., gt=0, description="local disk read/write bandwidth per node, GB/s")
    cores: int | None = Field(None, ge=1, description="CPU cores a node's CPU processes share (None: each device computes alone, a GPU)")
    wake_us: float = Field(
        0.0,
        ge=0,
        description="where a node's CPU processes outnumber its cores: what a blocking message takes beyond its latency while "
        "the other processes compute (the woken rank waits for a core), measured by calibrate",
    )
    message_cpu_us: float = Field(
        0.0,
        ge=0,
        description="CPU processes: CPU a process spends per point-to-point message it sends or receives between "
        "computations (its transport thread's work included), measured by calibrate; 0 where the device moves messages",
    )


class ClusterSpec(Spec):
    """`nodes` x `devices_per_node` identical devices, the links between them, and the hosts."""

    name: str
    nodes: int = Field(1, ge=1)
    devices_per_node: int = Field(..., ge=1)
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec | None = None
    host: HostSpec
    source: str = Field("", description="where the figures come from (vendor documents, or `behemoth calibrate` on a machine)")
    measured: dict[str, list[tuple[float, float]]] = Field(default_factory=dict, description="raw curves behind a calibration")
    kind: Literal["preset", "calibrated", "described"] = "described"

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    def with_nodes(self, devices: int) -> ClusterSpec:
        """The same hardware with enough nodes for `devices` devices (a preset names one server; a plan may span many)."""
        nodes = max(1, math.ceil(devices / self.devices_per_node))
        return self.model_copy(update={"nodes": nodes})

    def link(self, span: int) -> LinkSpec:
        """The link a group of devices `span` consecutive ranks wide runs over: within a node, or between nodes."""
        if span <= self.devices_per_node or self.inter_node is None:
            return self.intra_node
        return self.inter_node

    def collective(self, op: str, nbytes: float, ranks: int, stride: int = 1) -> float:
        """Seconds of one `op` of `nbytes` over a group of `ranks` devices `stride` ranks apart (a data-parallel group
        is tp apart). A group that spans nodes crosses them on as many links at once as it has devices per node
        (each device its own NIC, as in a DGX), up to the bandwidth within the node."""
        if ranks <= 1 and op != "p2p":
            return 0.0
        link = self.link(ranks * stride)
        if link is self.intra_node:
            return link.seconds(op, nbytes, ranks)
        per_node = max(1, min(ranks, self.devices_per_node // max(1, stride)))
        rails = max(1.0, min(per_node, self.intra_node.bandwidth_gbs / link.bandwidth_gbs))
        return link.seconds(op, nbytes, ranks, rails)

    @property
    def core_sharing(self) -> float:
        """Ranks per core on a node whose CPU processes outnumber its cores (1 when each has its own)."""
        cores = self.host.cores
        return self.devices_per_node / cores if cores and self.devices_per_node > cores else 1.0

    @property
    def wake_seconds(self) -> float:
        """Seconds a rank woken by a point-to-point message waits for a core (0 when each rank has its own)."""
        return self.host.wake_us * 1e-6 if self.core_sharing > 1.0 else 0.0

    @property
    def message_cpu_seconds(self) -> float:
        """CPU seconds a rank spends on each message it sends or receives between computations, a pipeline's or a
        collective's (CPU processes, as calibrated; 0 on GPUs, whose transfers run beside the host)."""
        return self.host.message_cpu_us * 1e-6

    def messages_cpu(self, op: str, ranks: int, count: float = 1.0) -> float:
        """CPU seconds `count` collectives `op` over `ranks` cost each rank in messages (`MESSAGE_ENDS` per other rank,
        a ring step of `p2p` two, each `message_cpu_seconds`): in line with the computation that waits for them, and
        not hidden by any overlap. 0 on GPUs and for a group of one."""
        if ranks <= 1 or not self.host.message_cpu_us:
            return 0.0
        ends = 2 if op == "p2p" else MESSAGE_ENDS[op] * (ranks - 1)
        return count * ends * self.message_cpu_seconds

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def load_cluster(path_or_name: str | Path) -> ClusterSpec:
    """A cluster file, or the name of a preset (`behemoth plan --cluster a100-80gb`)."""
    path = Path(path_or_name).expanduser()
    if not path.is_file():
        preset = PRESET_DIR / f"{path_or_name}.yaml"
        if not preset.is_file():
            raise BehemothError(
                f"--cluster {path_or_name} is neither a file nor a preset",
                f"pass a YAML file written by behemoth calibrate, or one of: {', '.join(preset_names())}",
            )
        path = preset
    try:
        raw = yaml.safe_load(path.read_text())
        return ClusterSpec.model_validate(raw)
    except (yaml.YAMLError, ValidationError) as err:
        first = err.errors()[0] if isinstance(err, ValidationError) else None
        where = f" ({'.'.join(map(str, first['loc']))}: {first['msg']})" if first else ""
        raise BehemothError(f"cluster file {path} is not a valid cluster description{where}", "see behemoth/planner/clusters/*.yaml") from None


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
