"""A short calibration of the rates a streamed step depends on: disk read and write, host-tier copies, compute.

The disk is measured in the scratch directory's file system: a file written with fsync (so the write
reaches the disk), its pages dropped from the page cache (so the read comes from the disk), read back,
removed. Host copies are a large tensor copied on the device (on a GPU: pinned host memory to the device).
Compute is a float32 matrix product, as metrics.measure_peak_tflops measures it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from behemoth.metrics import measure_peak_tflops, synchronize
from behemoth.offload.scratch import existing_ancestor

CHUNK = 16 * 2**20


@dataclass(frozen=True)
class Rates:
    """The rates a streamed step depends on: disk read and write, host-tier copies (bytes/s), compute (FLOP/s); and how
    long measuring them took (0 for rates given rather than measured)."""

    disk_read: float
    disk_write: float
    host_copy: float
    compute: float
    seconds: float = 0.0


def measure_disk(folder: Path, nbytes: int) -> tuple[float, float]:
    """(read, write) bytes/s of the disk under `folder`, writing and reading `nbytes` once."""
    folder = existing_ancestor(folder)
    path = folder / f".behemoth-calibration-{os.getpid()}.bin"
    block = os.urandom(CHUNK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(max(1, nbytes // CHUNK)):
            os.write(fd, block)
        os.fsync(fd)
        write = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages go: the read below comes from the disk
        buf = bytearray(CHUNK)
        t0 = time.perf_counter()
        os.lseek(fd, 0, os.SEEK_SET)
        done = 0
        while (n := os.readv(fd, [buf])) > 0:
            done += n
        read = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    written = max(1, nbytes // CHUNK) * CHUNK
    return done / read, written / write


def measure_host_copy(device: torch.device, nbytes: int = 64 * 2**20) -> float:
    """Bytes/s of copying between the host tier and the device (on a CPU: a memory copy)."""
    n = nbytes // 4
    src = torch.ones(n, pin_memory=device.type == "cuda")
    dst = torch.empty(n, device=device)
    dst.copy_(src)
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    synchronize(device)
    return 3 * nbytes / (time.perf_counter() - t0)


def measure_matmul(device: torch.device, shape: tuple[int, int, int], seconds: float = 0.3) -> float:
    """FLOP/s of a float32 [m, k] @ [k, n] product, the shape a block's largest layer multiplies (best of a few repeats,
    run for about `seconds`: other work on the machine only ever slows a repeat down)."""
    m, k, n = shape
    g = torch.Generator(device=device).manual_seed(0)
    a, b = torch.randn(m, k, device=device, generator=g), torch.randn(k, n, device=device, generator=g)
    a @ b
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < seconds or best == float("inf"):
        synchronize(device)
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best


def calibrate(folder: Path, device: torch.device, *, disk_bytes: int = 256 * 2**20, matmul: tuple[int, int, int] | None = None) -> Rates:
    """Every rate, measured now (a second or two on a disk of 0.5 GB/s). `matmul`: the (tokens, width, output width) of
    the model's largest product; without it, torch's square 1024 product."""
    t0 = time.perf_counter()
    read, write = measure_disk(folder, disk_bytes)
    host = measure_host_copy(device)
    compute = measure_matmul(device, matmul) if matmul else measure_peak_tflops(device) * 1e12
    return Rates(read, write, host, compute, time.perf_counter() - t0)
