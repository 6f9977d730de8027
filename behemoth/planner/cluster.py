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
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from behemoth.errors import BehemothError

PRESET_DIR = Path(__file__).parent / "clusters"
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
GB = 1e9


class Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LinkSpec(Spec):
    """One kind of link: latency and bus bandwidth of each collective over it (`default` for any not listed)."""

    latency_us: float = Field(..., ge=0, description="fixed cost of one collective or transfer")
    bandwidth_gbs: float = Field(..., gt=0, description="bus bandwidth, GB/s per device (10^9 bytes)")
    ops: dict[str, tuple[float, float]] = Field(default_factory=dict, description="op -> (latency_us, bandwidth_gbs), measured")

    def seconds(self, op: str, nbytes: float, ranks: int) -> float:
        """Time of one `op` of `nbytes` (the full tensor) over `ranks` devices on this link."""
        if ranks <= 1 and op != "p2p":
            return 0.0
        latency, bandwidth = self.ops.get(op, (self.latency_us, self.bandwidth_gbs))
        return latency * 1e-6 + nbytes * bus_factor(op, ranks) / (bandwidth * GB)


def bus_factor(op: str, ranks: int) -> float:
    """Bytes each device moves per byte of the full tensor (nccl-tests' bus bandwidth convention)."""
    if op == "p2p":
        return 1.0
    share = (ranks - 1) / ranks
    return 2 * share if op == "all_reduce" else share


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
    memory_bandwidth_gbs: float = Field(..., gt=0, description="device memory bandwidth, GB/s")
    op_overhead_us: float = Field(5.0, ge=0, description="fixed cost of launching one operator")
    block_efficiency: float = Field(
        0.8,
        gt=0,
        le=1,
        description="share of the matrix rate a transformer block's forward and backward reach (attention, transposed products in backward)",
    )
    comm_overlap: float = Field(
        0.9,
        ge=0,
        le=1,
        description="share of a collective that can hide behind computation (GPUs: NCCL beside the kernels; CPUs whose cores all compute: little)",
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
