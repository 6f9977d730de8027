"""The step-time model's structure: matrix products priced by their (m, n, k), attention by FLOPs and score traffic,
collectives by alpha-beta with message-size and ring-size efficiency, ranks sharing cores, one pricing function
for every row of a ranking, and the published rows it is validated against."""

from __future__ import annotations

import pytest

from behemoth.config import load_config
from behemoth.planner.attention import attention_seconds
from behemoth.planner.cluster import GemmCurve, LinkSpec, fit_gemm, load_cluster
from behemoth.planner.comm import bytes_per, data_parallel_time
from behemoth.planner.cost import price
from behemoth.planner.layout import Layout, Workload
from behemoth.planner.steptime import step_time


@pytest.fixture(scope="module")
def a100():
    return load_cluster("a100-80gb")


@pytest.fixture(scope="module")
def gpt2xl():
    cfg = load_config(None, ["model=gpt2-1.5b"])
    return cfg, Workload.of(cfg)


def test_every_row_of_a_ranking_is_priced_by_one_function(a100, gpt2xl):
    """Each printed row equals `price` of its layout through the same path (the simulator for every pipelined row),
    so one layout under ZeRO-1 and ZeRO-2 (the same traffic with a pipeline) shows the same step."""
    from behemoth.planner.search import Space, search

    cfg, work = gpt2xl
    cluster = a100.with_nodes(64)
    ranked = search(work, cluster, 64, Space(cp=(1,)), cfg=cfg, top=8).ranked  # cp=2 wins unpinned: no pipeline is ranked
    assert len(ranked) == 8
    assert {c.time.simulated for c in ranked if c.layout.pp > 1} == {True}
    for c in ranked:
        again = price(work, c.layout.but(boundaries=c.bounds), cluster, exact=c.layout.pp > 1)
        assert again.step_seconds == pytest.approx(c.step_seconds, rel=1e-12)
    by_layout: dict = {}
    for c in ranked:
        if c.layout.pp > 1 and c.layout.zero in (1, 2):
            by_layout.setdefault(c.layout.but(zero=1, boundaries=None), []).append(c.time.passes)
    pairs = [v for v in by_layout.values() if len(v) > 1]
    assert pairs, "the ranking holds a pipelined layout under both ZeRO-1 and ZeRO-2"
    for passes in pairs:
        assert max(passes) == pytest.approx(min(passes), rel=1e-12)


def test_matrix_efficiency_rises_in_every_dimension_to_its_ceiling():
    curve = GemmCurve(ceiling=0.85, half=100.0)
    sizes = [1, 16, 128, 1024, 8192, 65536]
    for dim in range(3):
        values = []
        for n in sizes:
            mnk = [4096, 4096, 4096]
            mnk[dim] = n
            values.append(curve.efficiency(*mnk))
        assert all(a < b for a, b in zip(values, values[1:]))
    assert curve.efficiency(1e9, 1e9, 1e9) == pytest.approx(0.85, rel=1e-6)
    assert curve.efficiency(1e-3, 4096, 4096) < 1e-4


def test_a_wide_product_beats_a_narrow_one_of_the_same_flops(a100):
    """A geometric mean would price these alike; by (m, n, k), the skinny k costs more per FLOP."""
    dev = a100.device
    square = dev.gemm_seconds("bf16", 4096, 4096, 4096)
    skinny = dev.gemm_seconds("bf16", 4096 * 32, 4096, 128)  # same FLOPs, k = 128
    assert skinny > 1.3 * square
    one_token = dev.gemm_seconds("bf16", 1, 8192, 8192)  # memory-bound: the weight's bytes at the bandwidth
    assert one_token == pytest.approx(2 * (8192 * 8192 + 2 * 8192) / (dev.memory_bandwidth_gbs * 1e9), rel=1e-9)


def test_the_preset_curve_is_the_fit_to_its_published_measurements():
    from behemoth.planner.curves import fit_published, published_points

    h100 = load_cluster("h100-sxm").device
    fitted = fit_published("h100-sxm", h100.op_overhead_us)
    assert fitted.ceiling == pytest.approx(h100.gemm.ceiling, rel=0.01)
    assert fitted.half == pytest.approx(h100.gemm.half, rel=0.01)
    big = [p for p in published_points("h100-sxm")["points"] if p[0] * p[1] * p[2] * p[3] >= 2 * 2048**3]
    for b, m, n, k, rate in big:  # the large products within 15% of what was measured
        predicted = 2 * b * m * n * k / (2 * b * m * n * k / (h100.peak_rate("bf16") * h100.gemm.efficiency(b * m, n, k)) + 5e-6)
        assert predicted == pytest.approx(rate, rel=0.15)
    points = [(n, n, n, 0.8 * (n / (n + 64)) ** 3) for n in (128, 512, 2048, 8192)]
    exact = fit_gemm(points)
    assert exact.ceiling == pytest.approx(0.8, rel=0.03) and exact.half == pytest.approx(64, rel=0.08)


def test_materialized_scores_cost_their_traffic_and_flash_does_not(a100):
    """A narrow model at long sequences: materialized scores grow with s^2 in memory traffic, on top of the products."""
    cfg = load_config(None, ["model=gpt2-124m", "model.context=8192", "train.seq_len=4096", "train.global_batch=8"])
    work = Workload.of(cfg)
    lay = Layout(8, 1, 1, 0, False, 1, 1)
    flash = attention_seconds(work, lay, a100)
    mat_cluster = a100.model_copy(update={"device": a100.device.model_copy(update={"attention_kernel": "materialized"})})
    materialized = attention_seconds(work, lay, mat_cluster)
    assert materialized[0] > 1.5 * flash[0] and materialized[1] > flash[1]
    short = Workload.of(load_config(None, ["model=gpt2-124m", "train.seq_len=1024", "train.global_batch=8"]))
    ratio = attention_seconds(work, lay, mat_cluster)[0] / attention_seconds(short, lay, mat_cluster)[0]
    assert 12 < ratio < 20  # s x 4: the s^2 terms x 16, the products' efficiency a little better


def test_collectives_are_alpha_beta_with_size_and_ring_efficiency(a100):
    link = LinkSpec(latency_us=10.0, bandwidth_gbs=100.0, hop_latency_us=2.0, half_bytes=1e4)
    tiny = link.seconds("all_gather", 1024, 8)
    assert tiny == pytest.approx((10.0 + 2.0 * 7) * 1e-6, rel=0.05)  # latency-bound: alpha and seven ring steps
    big = link.seconds("all_gather", 8e9, 8)
    assert big == pytest.approx(8e9 * 7 / 8 / 100e9, rel=0.01)  # bandwidth-bound: the bus bandwidth
    # the same tensor over a larger ring: smaller chunks per step, more steps; slower per byte moved
    assert link.seconds("all_gather", 64e6, 512) / (511 / 512) > 1.5 * link.seconds("all_gather", 64e6, 8) / (7 / 8)
    cluster = a100.with_nodes(64)
    one_per_node = cluster.collective("all_reduce", 1e9, 8, stride=8)  # a data-parallel group tp = 8 apart
    whole_nodes = cluster.collective("all_reduce", 1e9, 64, stride=1)  # 8 devices per node: 8 NICs at once
    assert one_per_node > 4 * whole_nodes * (7 / 8) / (63 / 64)


def test_zero3_per_unit_traffic_grows_with_the_ring(a100, gpt2xl):
    """ZeRO-3 gathers every unit per micro-batch: at 512 data ranks across nodes each collective's latency and small
    chunks cost more than at 8 within a node, for the same parameters."""
    _, work = gpt2xl
    elements = work.census.psi
    small = data_parallel_time(work, Layout(8, 1, 1, 3, False, 1, 4), a100.with_nodes(8), elements, 0.0, 0.0)
    large = data_parallel_time(work, Layout(512, 1, 1, 3, False, 1, 4), a100.with_nodes(512), elements, 0.0, 0.0)
    assert large.traffic > 5 * small.traffic
    assert large.exposed == pytest.approx(large.traffic, rel=1e-9)  # nothing to hide behind
    hidden = data_parallel_time(work, Layout(512, 1, 1, 3, False, 1, 4), a100.with_nodes(512), elements, 10.0, 20.0)
    assert hidden.exposed < 0.2 * hidden.traffic  # behind ample compute only the first gather and last scatter stay


def test_ranks_sharing_cores_fill_the_pipeline_bubble():
    """On 4 CPU processes sharing 2 cores, a rank idle in the bubble lends its share: the step is at least the ranks'
    mean busy time, and shorter than when every rank had its own cores."""
    from behemoth.planner.calibrate import probe_spec

    spec = probe_spec(4)
    alone = spec.model_copy(update={"host": spec.host.model_copy(update={"cores": None})})
    shared = spec.model_copy(update={"host": spec.host.model_copy(update={"cores": 2})})
    cfg = load_config(None, ["model=gpt-1m", "train.global_batch=8", "train.seq_len=64"])
    work = Workload.of(cfg)
    lay = Layout(1, 1, 4, 0, False, 1, 8, "1f1b", 1)
    bounds = (0, 1, 2, 3, 4)
    apart, together = step_time(work, lay, alone, bounds, exact=True), step_time(work, lay, shared, bounds, exact=True)
    busy = apart.passes - apart.bubble
    assert together.passes < apart.passes
    assert together.passes >= busy * (1 - 1e-9)
    assert together.passes == pytest.approx(max(busy, apart.passes / 2), rel=1e-9)
    flat = Layout(4, 1, 1, 0, False, 1, 2)
    assert step_time(work, flat, shared, (0, 4)).total == pytest.approx(step_time(work, flat, alone, (0, 4)).total, rel=1e-12)


def test_overlapped_collectives_cost_the_compute_they_hide_behind(a100, gpt2xl):
    """A collective hidden behind the passes is not free: the computation beside it loses `overlap_slowdown` of its
    rate for as long as the two overlap (`contention`, part of `exposed`); without contention, or with no compute to
    hide behind, nothing is added; what is added never exceeds the slowdown times the traffic."""
    _, work = gpt2xl
    elements, lay, cluster = work.census.psi, Layout(64, 1, 1, 3, False, 1, 4), a100.with_nodes(64)
    free = cluster.model_copy(update={"device": cluster.device.model_copy(update={"overlap_slowdown": 0.0})})
    slowed = data_parallel_time(work, lay, cluster, elements, 10.0, 20.0)
    ideal = data_parallel_time(work, lay, free, elements, 10.0, 20.0)
    assert ideal.contention == 0.0 and slowed.contention > 0.0
    assert slowed.exposed > ideal.exposed
    assert slowed.exposed - ideal.exposed <= cluster.device.overlap_slowdown * slowed.traffic + 1e-12
    bare = data_parallel_time(work, lay, cluster, elements, 0.0, 0.0)  # nothing to hide behind: runs alone, no contention
    assert bare.contention == 0.0 and bare.exposed == pytest.approx(bare.traffic, rel=1e-9)


def test_zero3_hides_unit_by_unit(a100, gpt2xl):
    """ZeRO-3 prefetches one unit ahead: each unit's gather hides behind one unit's compute, not the whole pass's. With
    compute per unit shorter than a gather, more total compute than traffic still leaves gathers exposed; with compute
    per unit longer than a gather, only the first gather of forward and the last reduce-scatter stay."""
    _, work = gpt2xl
    elements, lay = work.census.psi, Layout(512, 1, 1, 3, False, 1, 1)
    cluster = a100.with_nodes(512)
    free = cluster.model_copy(update={"device": cluster.device.model_copy(update={"overlap_slowdown": 0.0})})
    units = work.census.shape.n_layer
    p, g = bytes_per(lay, work)
    gather = cluster.collective("all_gather", p * elements / units, 512)
    scatter = cluster.collective("reduce_scatter", g * elements / units, 512)
    ample = data_parallel_time(work, lay, free, elements, 2 * units * gather / 0.9, 2 * units * (gather + scatter) / 0.9)
    assert ample.exposed == pytest.approx(gather + scatter, rel=1e-6)
    # the same traffic with compute only in part of each unit's share: exposed grows unit by unit
    thin = data_parallel_time(work, lay, free, elements, units * gather / 2, units * (gather + scatter) / 2)
    forward = gather + (units - 1) * 0.55 * gather  # each unit's compute hides 0.9 x half a gather
    backward = (units - 1) * 0.55 * (gather + scatter) + max(0.55 * (gather + scatter), scatter)
    assert thin.exposed == pytest.approx(forward + backward, rel=1e-6)


def test_fsdp_rows_cover_zero3_across_nodes():
    """The published rows check ZeRO-3 data parallelism within a node and across 2-16 nodes, each row with its source."""
    from behemoth.planner.published import load_sources, row_layout

    rows = [(s, r) for s in load_sources() for r in s["rows"] if r["zero"] == 3]
    assert any(r["gpus"] <= 8 for _, r in rows) and any(r["gpus"] >= 128 for _, r in rows)
    assert all(s["url"] and r["where"] for s, r in rows)
    assert all(row_layout(r).dp == r["gpus"] for _, r in rows if r["tp"] == r["pp"] == 1)
