"""Energy from RAPL counters: the delta between two readings of a powercap tree (written here in sysfs's layout, one
package and one sub-zone), unwrapped once when the counter wraps; without a tree the meter says why."""

from __future__ import annotations

from pathlib import Path

import pytest

from behemoth.profiler.energy import energy_line, joules_between, read_counters


def zone(root: Path, name: str, uj: int, max_uj: int = 10**9) -> None:
    (root / name).mkdir(parents=True, exist_ok=True)
    (root / name / "energy_uj").write_text(f"{uj}\n")
    (root / name / "max_energy_range_uj").write_text(f"{max_uj}\n")


def test_rapl_delta_and_wrap(tmp_path: Path) -> None:
    zone(tmp_path, "intel-rapl:0", 5_000_000)
    zone(tmp_path, "intel-rapl:0:0", 1_000_000)  # a sub-zone (cores): inside the package's count, not added to it
    before = read_counters(tmp_path)
    zone(tmp_path, "intel-rapl:0", 7_500_000)
    assert joules_between(before, read_counters(tmp_path)) == {"rapl:intel-rapl:0": pytest.approx(2.5)}
    zone(tmp_path, "intel-rapl:0", 500_000)  # wrapped at 1000 J
    assert joules_between(before, read_counters(tmp_path))["rapl:intel-rapl:0"] == pytest.approx(1000 - 5 + 0.5)
    assert "2.50 J per step" in energy_line({"rapl:intel-rapl:0": 5.0}, 2, [])


def test_no_counters_says_why(tmp_path: Path) -> None:
    reading = read_counters(tmp_path / "absent")
    assert not any(k.startswith("rapl") for k in reading.joules)
    assert any(m.startswith("RAPL: no ") for m in reading.missing)
    assert energy_line({}, 3, reading.missing).startswith("energy: not measured (RAPL: no ")
