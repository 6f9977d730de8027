"""Energy from the hardware's own counters, where this process can read them: RAPL on CPUs (the powercap tree,
/sys/class/powercap/intel-rapl:N/energy_uj, one counter per package, wrapping at max_energy_range_uj) and NVML on
GPUs (total energy since the driver loaded, through pynvml). Where neither is readable the meter says why instead
of guessing a number.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

POWERCAP = Path("/sys/class/powercap")


@dataclass
class Reading:
    """Counters at one moment: joules per source, and why each unreadable source was skipped."""

    joules: dict[str, float] = field(default_factory=dict)
    ranges: dict[str, float] = field(default_factory=dict)  # a counter's wrap-around, joules
    missing: list[str] = field(default_factory=list)


def rapl_packages(root: Path = POWERCAP) -> list[Path]:
    """The top-level RAPL domains (packages), not their sub-zones (core, dram)."""
    return sorted(p for p in root.glob("intel-rapl:*") if p.name.count(":") == 1)


def read_counters(root: Path = POWERCAP) -> Reading:
    """Every readable counter now."""
    out = Reading()
    packages = rapl_packages(root)
    if not packages:
        out.missing.append(f"RAPL: no {root}/intel-rapl:* (not an Intel/AMD host with powercap, or not exposed here)")
    for zone in packages:
        try:
            out.joules[f"rapl:{zone.name}"] = int((zone / "energy_uj").read_text()) / 1e6
            out.ranges[f"rapl:{zone.name}"] = int((zone / "max_energy_range_uj").read_text()) / 1e6
        except (OSError, ValueError) as err:
            out.missing.append(
                f"RAPL {zone.name}: {err.__class__.__name__} ({'run as root or grant read access' if isinstance(err, PermissionError) else err})"
            )
    read_nvml(out)
    return out


def read_nvml(out: Reading) -> None:
    """Each GPU's total energy counter (millijoules since the driver loaded), if pynvml and a GPU are there."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        out.missing.append("NVML: pynvml is not installed")
        return
    try:
        pynvml.nvmlInit()
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            out.joules[f"nvml:gpu{i}"] = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3
    except Exception as err:  # no driver, no GPU, or a GPU without the counter
        out.missing.append(f"NVML: {err}")


def joules_between(before: Reading, after: Reading) -> dict[str, float]:
    """Energy per source between two readings (a RAPL counter that wrapped once is unwrapped)."""
    out = {}
    for name, end in after.joules.items():
        if name in before.joules:
            delta = end - before.joules[name]
            out[name] = delta + after.ranges[name] if delta < 0 and name in after.ranges else delta
    return out


def energy_line(joules: dict[str, float], steps: int, missing: list[str]) -> str:
    """`energy: 12.3 J per step (rapl:intel-rapl:0 ...)` or why it was not measured."""
    if not joules:
        return "energy: not measured (" + "; ".join(missing) + ")"
    total = sum(joules.values())
    parts = ", ".join(f"{k} {v:.1f} J" for k, v in joules.items())
    return f"energy: {total / steps:.2f} J per step, {total / 3.6e6:.3g} kWh in {steps} steps ({parts}; whole devices, other work included)"


def run_energy(before: Reading, after: Reading, kwh_price: float | None) -> dict[str, Any]:
    """A run's energy for its summary and metrics: joules and kWh over the readable counters (this host's packages and
    GPUs, whole devices), the cost at `kwh_price` per kWh when given, and why a source was not read."""
    joules = joules_between(before, after)
    total = sum(joules.values())
    out: dict[str, Any] = {"sources": sorted(joules), "missing": list(after.missing)}
    if joules:
        out.update(joules=total, kwh=total / 3.6e6)
        if kwh_price is not None:
            out["cost"] = total / 3.6e6 * kwh_price
    return out


def run_energy_line(energy: dict[str, Any]) -> str:
    """The closing line's energy: `energy 0.0123 kWh (44.3 kJ over rapl:intel-rapl:0, whole devices; ~$0.002 at
    run.kwh_price)`, or why it was not measured."""
    if "kwh" not in energy:
        return "energy not measured (" + "; ".join(energy.get("missing") or ["no counter"]) + ")"
    cost = f"; ~${energy['cost']:.4g} at run.kwh_price" if "cost" in energy else ""
    return f"energy {energy['kwh']:.4g} kWh ({energy['joules'] / 1e3:.3g} kJ over {', '.join(energy['sources'])}, whole devices{cost})"
