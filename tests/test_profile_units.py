"""Pure parts of the profiler: energy from RAPL counters (the delta between two readings of a powercap tree, written
here in sysfs's layout, unwrapped once when the counter wraps; without a tree the meter says why), and which
parallel dimension a collective is charged to."""

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


def test_collectives_are_charged_to_their_dimension() -> None:
    """A group named by the mesh is its dimension; a group of all ranks (the flight recorder's `world`) is the one
    dimension wider than one when there is only one, else data parallel."""
    from behemoth.profiler.spans import comm_kind

    tp_only = {(0, 1): "tp"}
    assert comm_kind("world", [0, 1], tp_only) == "comm_tp"
    assert comm_kind("pp", [0, 2], {}) == "comm_pp"
    mixed = {(0, 1): "tp", (0, 2): "dp"}
    assert comm_kind("world", [0, 1, 2, 3], mixed) == "comm_dp"
    assert comm_kind("group", [2, 0], mixed) == "comm_dp" and comm_kind("group", [1, 0], mixed) == "comm_tp"


def test_a_group_across_nodes_is_charged_to_the_network() -> None:
    """With 2 ranks per node, a group of ranks 0 and 1 stays on node 0; 1 and 2 cross to node 1."""
    from behemoth.profiler.spans import comm_kind

    dims = {(0, 1): "tp", (0, 2): "dp"}
    assert comm_kind("tp", [0, 1], dims, node_size=2) == "comm_tp"
    assert comm_kind("tp", [1, 2], dims, node_size=2) == "comm_tp_net"
    assert comm_kind("group", [0, 2], dims, node_size=2) == "comm_dp_net"
    assert comm_kind("group", [0, 2], dims, node_size=4) == "comm_dp"
    assert comm_kind("group", [0, 2], dims) == "comm_dp"  # no node size: one node
