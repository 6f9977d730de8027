"""Collectives priced by the size of the group that runs them: `behemoth calibrate` on 4 or more processes also times
every collective on the world cut into pairs (all pairs at once, as a job's tensor- or data-parallel groups run), and
a group of 2 is priced by the pairs' curve, not by the whole world's. On 4 processes sharing 2 cores a pair's
all-reduce of 64 KiB between products took 1.9 ms against the world's 4.7 ms (medians, this machine), so pricing a
tp = 2 group by the world's curve made tensor parallelism look more than twice as slow as it runs."""

from __future__ import annotations

import math

import pytest
import torch

from behemoth.planner.calibrate import spec_from
from behemoth.planner.cluster import LinkSpec, load_cluster
from behemoth.planner.compute import price_block
from behemoth.planner.layout import Layout
from behemoth.planner.pingpong import group_collectives
from tests.dist import run_ranks
from tests.test_plan_cli import measured_here
from tests.test_planner_message_cpu import work

WORLD = [(2**12, 4e-3), (2**20, 5e-3), (2**23, 12e-3)]  # the whole world's curve: slow (4 ranks on 2 cores)
PAIRS = [(2**12, 1e-3), (2**20, 1.5e-3), (2**23, 6e-3)]  # pairs at once: a quarter of the latency


def four_processes(pairs: bool) -> dict:
    m = measured_here(0.0) | {"world": 4}
    m["collectives"] = {op: WORLD for op in m["collectives"]}
    if pairs:
        m["group_collectives"] = {2: {op: PAIRS for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")}}
    return m


def test_a_pair_is_priced_by_the_pairs_curve_and_the_world_by_its_own(tmp_path):
    spec = spec_from(four_processes(pairs=True))
    path = tmp_path / "here.yaml"
    path.write_text(spec.to_yaml())
    spec = load_cluster(path)  # group sizes survive the file
    assert sorted(spec.intra_node.group_ops) == [2, 4]
    for op in ("all_reduce", "all_gather"):
        assert spec.collective(op, 4096, 2) == pytest.approx(1e-3, rel=0.01)
        assert spec.collective(op, 4096, 4) == pytest.approx(4e-3, rel=0.01)
    assert spec.collective("p2p", 4096, 2) == pytest.approx(4e-3, rel=0.01)  # a transfer: measured once, between two ranks
    # without the pairs' measurement (an older file) every group takes the world's curve
    old = spec_from(four_processes(pairs=False))
    assert old.intra_node.group_ops == {} and old.collective("all_reduce", 4096, 2) == pytest.approx(4e-3, rel=0.01)


def test_the_nearest_measured_size_prices_a_group():
    link = LinkSpec(
        latency_us=1.0,
        bandwidth_gbs=1.0,
        ops={"all_reduce": (900.0, 1.0)},
        group_ops={2: {"all_reduce": (100.0, 1.0)}, 8: {"all_reduce": (800.0, 1.0)}},
    )
    assert link.measured("all_reduce", 2) == (100.0, 1.0)
    assert link.measured("all_reduce", 3) == (100.0, 1.0)  # log2(3/2) < log2(8/3)
    assert link.measured("all_reduce", 4) == (800.0, 1.0)  # a tie by factor: the larger group's
    assert link.measured("all_reduce", 16) == (800.0, 1.0)
    assert link.measured("all_gather", 2) is None


def test_tensor_parallel_pairs_on_four_processes_cost_what_the_pairs_measured():
    """A tp = 2 block on 4 processes: its all-reduces at the pairs' latency, a quarter of the world's."""
    lay = Layout(tp=2, dp=2, micro_batch=2, microbatches=4)
    w = work()
    specs = [spec_from(four_processes(pairs=p)) for p in (True, False)]
    cheap, dear = (price_block(w, lay, s) for s in specs)
    hidden = lay.tokens(w.seq_len) * w.census.shape.d_model * w.act_bytes
    pair = 1e-3 + hidden / (2**23 / 5e-3)  # the pairs' latency and bus bandwidth (fit_link: 8 MiB in 6 ms less 1)
    assert cheap.comm == pytest.approx(2 * pair)  # a pass's two all-reduces
    assert dear.comm == pytest.approx(2 * (4e-3 + hidden / (2**23 * 1.5 / 8e-3)))  # the world's, fitted over 4 ranks
    assert cheap.forward == dear.forward


def measure_groups() -> dict:
    import torch.distributed as dist

    from behemoth.topology import init_runtime

    rt = init_runtime(timeout_s=60.0)
    try:
        got = group_collectives((2**10, 2**14), torch.device("cpu"), rt.world_group)
        return {n: {op: [list(p) for p in curve] for op, curve in by_op.items()} for n, by_op in got.items()} | {"rank": dist.get_rank()}
    finally:
        rt.close()


def test_calibrate_times_every_pair_at_once():
    got = run_ranks(4, measure_groups, timeout=120)
    for r in got:
        assert sorted(k for k in r if k != "rank") == [2]  # 4 ranks: pairs only (the world is `collectives`)
        assert sorted(r[2]) == ["all_gather", "all_reduce", "all_to_all", "reduce_scatter"]
        for curve in r[2].values():
            assert [b for b, _ in curve] == [2.0**10, 2.0**14]
            assert all(math.isfinite(s) and s > 0 for _, s in curve)
