"""The burst planner's dynamic program: its data-parallel limit, its optimum, its amplification cap, its command."""

from __future__ import annotations

import itertools
import math

import pytest

from behemoth.config import load_config
from behemoth.errors import BehemothError
from behemoth.planner.burst import BurstPlan, BurstProblem, plain_data_parallel, reshard_rows, simulate_cluster
from behemoth.planner.cluster import load_cluster
from behemoth.planner.layout import Layout, Workload


def workload(*options: str) -> Workload:
    return Workload.of(load_config(None, ["model=gpt-tiny", "train.global_batch=8", "train.seq_len=32", *options]))


def ideal_cluster(world: int):
    """A cluster on which every layer scales perfectly: no launch cost, one matmul efficiency, free links."""
    base = load_cluster("a100-80gb").with_nodes(world)
    device = base.device.model_copy(update={"op_overhead_us": 0.0, "matmul_efficiency": [(1, 0.5), (10**6, 0.5)], "memory_bandwidth_gbs": 1e12})
    link = base.intra_node.model_copy(update={"latency_us": 0.0, "bandwidth_gbs": 1e12})
    return base.model_copy(update={"device": device, "intra_node": link, "inter_node": link})


@pytest.mark.parametrize("preset,world,batch", [("a100-80gb", 8, 8), ("h100-sxm", 32, 64)])
def test_one_width_prices_exactly_as_plain_data_parallelism(preset, world, batch):
    work = workload(f"train.global_batch={batch}", "model=gpt-1m")
    cluster = load_cluster(preset).with_nodes(world)
    problem = BurstProblem(work, cluster, world, sums="buckets")  # DDP's bucketed sums, as cost.price prices them
    plan = problem.plan_of((world,) * problem.layers)
    assert plan.step_seconds == pytest.approx(plain_data_parallel(work, cluster, world), rel=1e-12)
    # the uniform-split search limited to the full width, with no cap, is plain data parallelism
    only = BurstProblem(work, cluster, world, widths=(world,), sums="buckets").solve(math.inf, uniform=True)
    assert only.widths == (world,) * problem.layers and only.step_seconds == pytest.approx(plan.step_seconds, rel=1e-12)


def test_perfect_scaling_without_a_cap_is_data_parallelism():
    """Where every layer scales perfectly, the dynamic program with amplification -> infinity gives every layer the world."""
    world, work = 8, workload()
    cluster = ideal_cluster(world)
    plan = BurstProblem(work, cluster, world, sums="buckets").solve(math.inf)
    assert plan.widths == (world,) * (work.census.shape.n_layer + 2)
    assert plan.step_seconds == pytest.approx(plain_data_parallel(work, cluster, world), rel=1e-9)


@pytest.mark.parametrize("model", ["gpt-tiny", "gpt-1m"])
def test_dynamic_program_finds_the_brute_force_optimum(model):
    world, work = 4, workload("train.global_batch=4", f"model={model}")
    cluster = load_cluster("a100-80gb").with_nodes(world)
    problem = BurstProblem(work, cluster, world)
    for cap in (math.inf, 2.0, 1.2):
        ok = problem.allowed(cap)
        widths, seconds = problem.dynamic_program(ok)
        assert seconds + problem.optimizer == pytest.approx(problem.plan_of(widths).step_seconds, rel=1e-12)
        every = [
            problem.plan_of(w, cap).step_seconds
            for w in itertools.product(problem.widths, repeat=problem.layers)
            if all(ok[i][problem.widths.index(c)] for i, c in enumerate(w))
        ]
        assert problem.solve(cap).step_seconds == pytest.approx(min(every), rel=1e-12)


def test_amplification_cap_is_respected_and_binds():
    # 64 sequences: enough work per layer that spreading it beats an A100's launch floor (at 8 every layer stays on one)
    world, work = 8, workload("model=gpt-1m", "train.seq_len=64", "train.global_batch=64")
    cluster = load_cluster("a100-80gb").with_nodes(world)
    problem = BurstProblem(work, cluster, world)
    free = problem.solve(math.inf)
    capped = problem.solve(1.5)
    assert all(c == 1 or problem.amplification(i, c) <= 1.5 + 1e-12 for i, c in enumerate(capped.widths))
    assert free.step_seconds <= capped.step_seconds
    assert any(problem.amplification(i, c) > 1.5 for i, c in enumerate(free.widths)), "the cap should bind at this point"
    with pytest.raises(BehemothError, match="amplification 0.5"):
        problem.solve(0.5)


def test_reshard_rows_counts_what_moves():
    assert reshard_rows(8, 2, 2, 4) == 0
    assert reshard_rows(8, 2, 4, 4) == 4  # rank 1 holds rows 4..8 and keeps none of them (it then needs 2..4)
    assert reshard_rows(8, 1, 4, 4) == 6  # rank 0 keeps 0..2 and sends 6 rows


def test_plan_file_round_trips():
    plan = BurstPlan((1, 2, 2, 1), 2, 8, 2.0, 0.1, {}, 0.1)
    again = BurstPlan.from_yaml(plan.to_yaml())
    assert (again.widths, again.world, again.global_batch) == ((1, 2, 2, 1), 2, 8)


def test_cluster_simulator_at_strong_scaling():
    """gpt2-124m, one sequence per A100 on 64 of them: the numbers the benchmark prints, and their invariants."""
    work = Workload.of(load_config(None, ["model=gpt2-124m", "train.global_batch=64", "train.seq_len=1024", "train.precision=bf16"]))
    point = simulate_cluster(work, load_cluster("a100-80gb"), 64)
    assert point.per_device_batch == 1
    assert point.burst.step_seconds <= point.dp_step * (1 + 1e-12) or point.burst.amplification < math.inf
    assert 0 < point.burst.idle_fraction < 1 and point.cluster_throughput >= point.foreground_ratio


def test_plan_burst_command(capsys):
    from behemoth.cli.plan import plan_main

    code = plan_main(["--burst", "--cluster", "a100-80gb", "--world", "16", "model=gpt-1m", "train.global_batch=16", "train.seq_len=64"])
    out = capsys.readouterr().out
    assert code == 0 and "burst plan" in out and "data parallelism" in out, out
    assert plan_main(["--burst", "--amplification", "0.5", "--cluster", "a100-80gb", "model=gpt-tiny"]) == 2


def shared_core_cluster(world: int, cores: int):
    """`world` CPU-like ranks on one node of `cores` cores (the preset's rates read as measured with every rank busy)."""
    base = load_cluster("a100-80gb")
    host = base.host.model_copy(update={"cores": cores})
    device = base.device.model_copy(update={"async_launch": False})  # a CPU runs each operator as it issues it
    return base.model_copy(update={"devices_per_node": world, "nodes": 1, "host": host, "device": device})


def test_ranks_sharing_cores_compute_faster_when_fewer_are_busy():
    """4 ranks on 2 cores: a layer on 1 or 2 ranks runs each at a whole core (twice the all-busy rate), on 4 at the
    calibrated rate; on a node with a core per rank nothing changes."""
    work = workload("train.global_batch=4")
    shared = BurstProblem(work, shared_core_cluster(4, 2), 4)
    alone = BurstProblem(work, shared_core_cluster(4, 4), 4)
    assert shared.widths == (1, 2, 4)
    for c, speedup in ((1, 2.0), (2, 2.0), (4, 1.0)):
        for layer in range(shared.layers):
            assert shared.costs[c].train[layer] == pytest.approx(alone.costs[c].train[layer] / speedup, rel=1e-12)
    assert shared.plan_of((4,) * shared.layers).step_seconds == pytest.approx(alone.plan_of((4,) * alone.layers).step_seconds, rel=1e-12)


@pytest.mark.parametrize("cluster", [shared_core_cluster(4, 2), load_cluster("a100-80gb").with_nodes(4)], ids=["2 cores", "a100"])
def test_cost_terms_have_their_structural_properties(cluster):
    """What must hold whatever the calibration: no transfer between equal widths and the same both ways (forward
    activations and backward gradients), no sync on one rank, DDP-bucketed sync growing with the
    parameters synced and overlapped per-layer sums between their first layer's and all of them unhidden, a layer's
    seconds never growing with its width up to the cores, a plan's price the sum of its parts; and the program's optimum still the
    brute-force one when ranks share cores (per-rank speed no longer proportional to 1 / width)."""
    world, work = 4, workload("train.global_batch=4")
    problem = BurstProblem(work, cluster, world)
    for a, b in itertools.product(problem.widths, repeat=2):
        assert problem.transfer(a, b) == pytest.approx(problem.transfer(b, a), rel=1e-12)
        assert (problem.transfer(a, b) == 0.0) == (a == b)
    assert problem.run_seconds(0, problem.layers, 1)[1] == 0.0
    buckets = BurstProblem(work, cluster, world, sums="buckets")
    for c in problem.widths[1:]:
        syncs = [buckets.run_seconds(0, end, c)[1] for end in range(1, problem.layers + 1)]
        assert syncs == sorted(syncs) and syncs[0] > 0
        # overlapped per-layer sums: a run exposes at least its first layer's sum, at most every layer's sum unhidden
        alone = [problem.run_seconds(i, i + 1, c)[1] for i in range(problem.layers)]
        for end in range(1, problem.layers + 1):
            assert alone[0] * (1 - 1e-12) <= problem.run_seconds(0, end, c)[1] <= sum(alone[:end]) * (1 + 1e-12)
    cores = cluster.host.cores or world  # past the cores, more ranks share them: a layer may get slower
    for layer in range(problem.layers):
        seconds = [problem.costs[c].train[layer] for c in problem.widths if c <= cores]
        assert all(a >= b * (1 - 1e-12) for a, b in zip(seconds, seconds[1:])), seconds  # equal at a launch floor
    for widths in ((1, 2, 4, 1), (4, 1, 2, 4)):
        plan = problem.plan_of(widths)
        assert plan.step_seconds == pytest.approx(sum(plan.parts.values()), rel=1e-12)
    ok = problem.allowed(math.inf)
    best = min(problem.plan_of(w).step_seconds for w in itertools.product(problem.widths, repeat=problem.layers))
    assert problem.solve(math.inf).step_seconds == pytest.approx(best, rel=1e-12)
    assert problem.dynamic_program(ok)[1] + problem.optimizer == pytest.approx(best, rel=1e-12)


def with_adamw(cluster, fixed_us: float, ns_per_element: float):
    from behemoth.planner.cluster import AdamWRate

    rate = AdamWRate(fixed_us=fixed_us, ns_per_element=ns_per_element)
    return cluster.model_copy(update={"device": cluster.device.model_copy(update={"adamw": rate})})


def test_measured_adamw_rate_prices_each_rank_by_the_elements_it_holds():
    """With a calibrated AdamW rate, rank r's optimizer step is fixed + rate x the elements of the layers at least r + 1
    wide: it grows with what the rank holds, is zero for a rank that holds nothing, and rank 0 (every layer) is the
    plan's optimizer part."""
    world, work = 4, workload("train.global_batch=4")
    cluster = with_adamw(load_cluster("a100-80gb").with_nodes(world), 50.0, 2.0)
    problem = BurstProblem(work, cluster, world)
    elements = problem.costs[1].elements
    widths = (2, 1, 2, 2)  # embedding and head on ranks 0-1, block 1 on rank 0 alone, block 2 on ranks 0-1
    assert problem.rank_optimizer(widths, 0) == pytest.approx(50e-6 + 2e-9 * sum(elements), rel=1e-12)
    assert problem.rank_optimizer(widths, 1) == pytest.approx(50e-6 + 2e-9 * (sum(elements) - elements[1]), rel=1e-12)
    assert problem.rank_optimizer(widths, 2) == problem.rank_optimizer(widths, 3) == 0.0
    assert problem.plan_of(widths).parts["optimizer"] == pytest.approx(problem.rank_optimizer(widths, 0), rel=1e-12)
    doubled = BurstProblem(work, with_adamw(cluster, 50.0, 4.0), world)
    assert doubled.optimizer - 50e-6 == pytest.approx(2 * (problem.optimizer - 50e-6), rel=1e-12)


def test_optimizer_price_follows_the_zero_share():
    """steptime's optimizer price at the measured rate: a ZeRO rank steps its 1/shard_ranks of the elements."""
    from behemoth.planner.steptime import optimizer_seconds

    work = workload()
    cluster = with_adamw(load_cluster("a100-80gb").with_nodes(8), 0.0, 3.0)
    whole = optimizer_seconds(work, Layout(dp=8), cluster, 1e6)
    share = optimizer_seconds(work, Layout(dp=8, zero=1), cluster, 1e6)
    assert whole == pytest.approx(3e-3, rel=1e-12) and share == pytest.approx(whole / 8, rel=1e-12)
    assert optimizer_seconds(work, Layout(dp=8), cluster, 0.0) == 0.0
    assert optimizer_seconds(work, Layout(dp=8), load_cluster("a100-80gb").with_nodes(8), 0.0) == 0.0
