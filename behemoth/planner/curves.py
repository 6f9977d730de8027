"""Published matrix-product measurements behind the presets' (m, n, k) efficiency curves (planner/curves/*.yaml).

A preset's `device.gemm` is fitted to measurements someone else published (the file names them); `fit_published`
repeats that fit, so a test can check that the shipped numbers are the fit and not a guess.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from behemoth.planner.cluster import GemmCurve, fit_gemm

CURVE_DIR = Path(__file__).parent / "curves"
MIN_LAUNCH_MULTIPLE = 4.0  # points whose time is under this many launch costs say more about the launch than the product


def published_points(device: str) -> dict:
    """The measurement file of preset `device` (batch, m, n, k, FLOP/s rows, its peak and its source)."""
    return yaml.safe_load((CURVE_DIR / f"{device}.yaml").read_text())


def fit_published(device: str, launch_us: float) -> GemmCurve:
    """The curve fitted to `device`'s published points: each time less one launch, a batch counted as more rows."""
    data = published_points(device)
    peak = data["peak_tflops"] * 1e12
    points = []
    for b, m, n, k, rate in data["points"]:
        seconds = 2.0 * b * m * n * k / rate
        if seconds < MIN_LAUNCH_MULTIPLE * launch_us * 1e-6:
            continue
        compute = seconds - launch_us * 1e-6
        points.append((b * m, n, k, 2.0 * b * m * n * k / compute / peak))
    return fit_gemm(points, source=data["source"])
