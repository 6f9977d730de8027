"""What a run measures and leaves behind: throughput, MFU, memory per rank, metrics.jsonl, loss.png."""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from behemoth.comm import watched
from behemoth.errors import BehemothError

PEAK_SIZE, PEAK_RUNS = 2048, 5  # the matmul every MFU figure is measured against, and how many tries


def measure_peak_tflops(device: torch.device, size: int = PEAK_SIZE, runs: int = PEAK_RUNS) -> float:
    """This rank's float32 matmul rate, as the peak MFU divides by: one size x size x size product at the process's
    thread count, timed `runs` times after a warm-up, the best kept (so a busy moment does not lower the peak); on a
    CPU the faster of torch's BLAS and oneDNN (training may use either: train.gemm)."""
    rates = [measure_matmul_tflops(device, size, runs)]
    if onednn_matmul(device):
        rates.append(measure_matmul_tflops(device, size, runs, onednn=True))
    return max(rates)


def onednn_matmul(device: torch.device) -> bool:
    """Whether a float32 product on `device` can run by oneDNN (a CPU whose torch has it)."""
    available = bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
    return device.type == "cpu" and available and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def measure_matmul_tflops(device: torch.device, size: int = PEAK_SIZE, runs: int = PEAK_RUNS, *, onednn: bool = False) -> float:
    """One library's float32 size^3 product rate (`a @ b`, or oneDNN's a b^T), best of `runs` after a warm-up. Its
    operands come from a generator of their own: the run's RNG is not touched."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=g)
    b = torch.randn(size, size, device=device, generator=g)

    def product() -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "") if onednn else a @ b

    product()  # warm up
    best = float("inf")
    for _ in range(runs):
        synchronize(device)
        t0 = time.perf_counter()
        product()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e12


def peak_source(device: torch.device, size: int = PEAK_SIZE, runs: int = PEAK_RUNS) -> str:
    """How `measure_peak_tflops` measured, in words, for the line that reports MFU."""
    where = "GPU" if device.type == "cuda" else f"{torch.get_num_threads()} CPU thread(s)"
    library = ", the faster of BLAS and oneDNN" if onednn_matmul(device) else ""
    return f"measured: float32 {size}x{size} matmul{library}, best of {runs}, {where} per rank"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_mb(device: torch.device) -> dict[str, float]:
    """This process's peak resident memory and, on GPUs, peak allocated device memory."""
    out = {"rss_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if device.type == "cuda":
        out["device_peak_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def gather_floats(values: list[float], device: torch.device, group: dist.ProcessGroup) -> list[list[float]]:
    """Every rank's `values` on every rank of `group` (one small all-gather)."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    with watched("all_gather", group):
        dist.all_gather(out, mine, group=group)
    return [t.tolist() for t in out]


class MetricsLog:
    """Appends one JSON object per line to metrics.jsonl (rank 0 only) and, with `tensorboard`, the same scalars as
    TensorBoard event files beside it (`TensorBoardLog`)."""

    def __init__(self, path: Path, *, truncate_after: int | None = None, tensorboard: bool = False) -> None:
        self.path = path
        self.validated: set[int] = set()  # steps of the run being resumed that have a validation loss
        self.trained: set[int] = set()  # ... and a training loss
        if truncate_after is not None and path.exists():  # a resumed run rewrites what came after its checkpoint
            kept = [r for r in read_metrics(path) if r.get("step", 0) <= truncate_after]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            self.validated = {r.get("step", 0) for r in kept if "val_loss" in r}
            self.trained = {r.get("step", 0) for r in kept if "loss" in r}
        self.file = open(path, "a")
        self.board = TensorBoardLog(path.parent, purge_after=truncate_after) if tensorboard else None

    def has_val(self, step: int) -> bool:
        return step in self.validated

    def has_loss(self, step: int) -> bool:
        return step in self.trained

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.board is not None:
            self.board.write(record)

    def close(self) -> None:
        self.file.close()
        if self.board is not None:
            self.board.close()


def tensorboard_available() -> bool:
    """Whether TensorBoard's event writer can be imported (the `tensorboard` package is installed)."""
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of one metrics.jsonl record: every number under its own name, and every list of numbers
    element by element (the per-rank memory lists as `name/rank<R>`, others as `name/<i>`) with its maximum as
    `name/max`. Text, flags and the step itself are not scalars."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in ("step", "time") or isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            out[key] = float(value)
        elif isinstance(value, list) and value and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
            each = "rank" if key.endswith("_mb") else ""  # memory is per rank; other lists (tokens per expert) by index
            out |= {f"{key}/{each}{i}": float(v) for i, v in enumerate(value)}
            out[f"{key}/max"] = float(max(value))
    return out


class TensorBoardLog:
    """The run's scalars as TensorBoard event files in the run directory (beside metrics.jsonl), so that `tensorboard
    --logdir runs/` shows every run, a sweep's trials among them, as comparable runs. A resumed run purges what came
    after its checkpoint, as metrics.jsonl is rewritten."""

    def __init__(self, folder: Path, *, purge_after: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise BehemothError(
                "run.tensorboard=true but the tensorboard package is not installed", "pip install tensorboard, or set run.tensorboard=false"
            ) from None

        self.writer = SummaryWriter(log_dir=str(folder), purge_step=None if purge_after is None else purge_after + 1)

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step")
        if step is None:
            return
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, global_step=int(step))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_loss(metrics_path: Path, out: Path) -> None:
    """Train and validation loss against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if train:
        ax.plot(*zip(*train), label="train", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(metrics_path.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
