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

PEAK_SIZE, PEAK_RUNS = 2048, 5  # the matmul every MFU figure is measured against, and how many tries


def measure_peak_tflops(device: torch.device, size: int = PEAK_SIZE, runs: int = PEAK_RUNS) -> float:
    """This rank's float32 matmul rate, as the peak MFU divides by: one size x size x size product at the process's
    thread count, timed `runs` times after a warm-up, the best kept (so a busy moment does not lower the peak).
    Its operands come from a generator of their own: the run's RNG is not touched."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=g)
    b = torch.randn(size, size, device=device, generator=g)
    a @ b  # warm up
    best = float("inf")
    for _ in range(runs):
        synchronize(device)
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e12


def peak_source(device: torch.device, size: int = PEAK_SIZE, runs: int = PEAK_RUNS) -> str:
    """How `measure_peak_tflops` measured, in words, for the line that reports MFU."""
    where = "GPU" if device.type == "cuda" else f"{torch.get_num_threads()} CPU thread(s)"
    return f"measured: float32 {size}x{size} matmul, best of {runs}, {where} per rank"


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
    """Appends one JSON object per line to metrics.jsonl (rank 0 only)."""

    def __init__(self, path: Path, *, truncate_after: int | None = None) -> None:
        self.path = path
        self.validated: set[int] = set()  # steps of the run being resumed that have a validation loss
        if truncate_after is not None and path.exists():  # a resumed run rewrites what came after its checkpoint
            kept = [r for r in read_metrics(path) if r.get("step", 0) <= truncate_after]
            path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            self.validated = {r.get("step", 0) for r in kept if "val_loss" in r}
        self.file = open(path, "a")

    def has_val(self, step: int) -> bool:
        return step in self.validated

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


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
