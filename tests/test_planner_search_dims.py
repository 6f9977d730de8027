"""The search over expert parallelism and offload tiers against brute force, its memory margin, and the chosen plan of
an MoE model run by `behemoth train`: the search's best plan is the optimum of its own cost model over every layout,
recompute set, stage boundary and offload placement, and no plan above the margin is chosen."""

from __future__ import annotations

import itertools

import pytest
import yaml

from behemoth.config import load_config
from behemoth.planner.cluster import load_cluster
from behemoth.planner.cost import price
from behemoth.planner.layout import Offload, Workload
from behemoth.planner.search import MEMORY_MARGIN, OFFLOAD_PLACEMENTS, Space, enumerate_layouts, host_fits, refusals, search

SCHEDULES = dict(schedules=("1f1b", "zb-h1", "interleaved"), chunks=(2,))
MOE = ["model=gpt-moe-tiny", "train.global_batch=8", "train.seq_len=32"]
DENSE = ["model=gpt-tiny", "model.n_layer=2", "train.global_batch=4", "train.seq_len=32"]


def small_cluster(memory_gb: float, host_gb: float = 1000.0):  # type: ignore[no-untyped-def]
    """A100 figures on 4 devices of one node, with `memory_gb` per device and `host_gb` of host memory."""
    cluster = load_cluster("a100-80gb").model_copy(update={"devices_per_node": 4})
    device = cluster.device.model_copy(update={"memory_gb": memory_gb, "reserved_gb": 0.0})
    return cluster.model_copy(update={"device": device, "host": cluster.host.model_copy(update={"memory_gb": host_gb})})


def brute_force(cfg, world: int, cluster, space: Space) -> list:  # type: ignore[no-untyped-def]
    """Every plan of the world that fits below the margin, priced on every rank: all degrees (ep included), ZeRO stages,
    micro-batch sizes, schedules, every recompute set, every set of stage boundaries and every offload placement."""
    work = Workload.of(cfg)
    n = work.census.shape.n_layer
    limit = cluster.device.usable_bytes * (1 - MEMORY_MARGIN)
    out = []
    for lay in enumerate_layouts(work, world, space, cluster, (Offload(), *OFFLOAD_PLACEMENTS)):
        bounds_options = [None] if lay.stages == 1 else [(0, *cut, n) for cut in itertools.combinations(range(1, n), lay.stages - 1)]
        for bounds in bounds_options:
            for k in range(lay.pp + 1):
                for ranks in itertools.combinations(range(lay.pp), k):
                    cost = price(work, lay.but(boundaries=bounds, recompute=ranks), cluster)
                    if cost.peak_memory <= limit and host_fits(cost, cluster, space):
                        out.append(cost)
    return out


def optimum(cfg, world: int, cluster, space: Space):  # type: ignore[no-untyped-def]
    """The brute-force best: the fastest plan on the devices that `problems()` accepts, or, only if none, the fastest
    offloaded one."""
    everything = sorted(brute_force(cfg, world, cluster, space), key=lambda c: c.step_seconds)
    accepted = [c for c in everything if not refusals(cfg, c.layout, world)]
    on_device = [c for c in accepted if not c.layout.offload.enabled]
    return (on_device or accepted)[0], everything


@pytest.mark.parametrize("memory_gb", [1.0, 0.0012])
def test_search_finds_the_brute_force_optimum_with_expert_parallelism(memory_gb):
    """A 4-expert model on 4 devices: ep in {1, 2, 4} against dp, tp and pp; with ample memory and with memory so tight
    that sharding the experts (or recomputing) decides what fits, the search's best is the brute-force best."""
    cfg = load_config(None, MOE)
    cluster, space = small_cluster(memory_gb), Space(**SCHEDULES)
    best, everything = optimum(cfg, 4, cluster, space)
    assert {c.layout.ep for c in everything} == {1, 2, 4}
    found = search(Workload.of(cfg), cluster, 4, space, cfg=cfg, exact=0).ranked[0]
    assert found.step_seconds == pytest.approx(best.step_seconds, rel=1e-9), (found.layout.describe(), best.layout.describe())
    if memory_gb < 0.01:  # tight: some plans fit only with experts sharded over ep
        assert any(c.layout.ep > 1 for c in everything) and not all(c.layout.ep > 1 for c in everything)


@pytest.mark.parametrize("memory_gb,host_gb", [(0.0004, 1000.0), (0.0004, 0.0005)])
def test_offload_is_chosen_only_when_nothing_fits_and_is_the_brute_force_optimum(memory_gb, host_gb):
    """Devices too small for any plan of a dense model on 2 processes: the search turns to offload and picks the
    brute-force best placement (host memory while the host holds it, else disk); with room on the devices it never
    offloads."""
    cfg = load_config(None, DENSE)
    cluster, space = small_cluster(memory_gb, host_gb), Space(**SCHEDULES)
    best, everything = optimum(cfg, 2, cluster, space)
    assert everything and all(c.layout.offload.enabled for c in everything)  # nothing fits on the devices alone
    result = search(Workload.of(cfg), cluster, 2, space, cfg=cfg, exact=0)
    found = result.ranked[0]
    assert found.layout.offload.enabled and found.step_seconds == pytest.approx(best.step_seconds, rel=1e-9), (
        found.layout.describe(),
        best.layout.describe(),
    )
    tiers = {found.layout.offload.params, found.layout.offload.optimizer}
    assert ("disk" in tiers) == (host_gb < 1), found.layout.describe()
    roomy = search(Workload.of(cfg), small_cluster(1.0), 2, space, cfg=cfg, exact=0).ranked
    assert roomy and not any(c.layout.offload.enabled for c in roomy)


def test_no_plan_within_the_margin_of_the_device_is_chosen():
    """Device memory set between the lightest plan's peak and that peak plus 5%: the plan that would have been chosen
    without the margin is not; with margin 0 it is."""
    cfg = load_config(None, DENSE)
    work, space = Workload.of(cfg), Space(**SCHEDULES, offload=(Offload(),))
    free = search(work, small_cluster(1.0), 2, space, cfg=cfg, exact=0).ranked[0]
    tight = small_cluster(free.peak_memory * 1.02 / 1e9)  # 2% headroom for the best unconstrained plan
    chosen = search(work, tight, 2, space, cfg=cfg, exact=0).ranked
    assert all(c.peak_memory <= tight.device.usable_bytes * (1 - MEMORY_MARGIN) for c in chosen)
    assert free.layout.describe() not in [c.layout.describe() for c in chosen]
    bare = search(work, tight, 2, Space(**SCHEDULES, offload=(Offload(),), margin=0.0), cfg=cfg, exact=0).ranked
    assert bare[0].layout.describe() == free.layout.describe()


def plan_file(tmp_path, capsys, *pins: str):  # type: ignore[no-untyped-def]
    """`behemoth plan --world 2 --out plan.yaml` for the tiny MoE model; the YAML's path and what the command printed."""
    from behemoth.cli import main

    out_file = tmp_path / "plan.yaml"
    common = [*MOE, "train.eval_every=0", "train.peak_tflops=1", "checkpoint.every=0", "run.progress=false", f"data.cache_dir={tmp_path / 'c'}"]
    assert main(["plan", "--cluster", "a100-80gb", "--world", "2", "--out", str(out_file), *common, *pins]) == 0
    return out_file, capsys.readouterr().out


def test_the_chosen_expert_parallel_plan_of_an_moe_model_trains(tmp_path, capsys):
    """With dp, tp and pp pinned to 1 the search's plan for 2 devices is ep=2; the YAML it writes passes every check
    `behemoth train` makes before launch and trains 2 steps on 2 ranks (the engine `behemoth train` runs, in-process)."""
    from behemoth.config import load_config
    from behemoth.planner.feasibility import launch_problems
    from tests.common import train_body
    from tests.dist import run_ranks

    out_file, printed = plan_file(tmp_path, capsys, "parallel.dp=1", "parallel.tp=1", "parallel.pp=1")
    assert "Assumptions behind these predictions:" in printed and "a plan keeps 5% of it free" in printed and "rows per token" in printed, printed
    assert yaml.safe_load(out_file.read_text())["parallel"]["ep"] == 2
    cfg = load_config(str(out_file), ["train.steps=2", f"run.dir={tmp_path / 'run'}"])
    assert launch_problems(cfg, 2, None) == []
    losses = [r["losses"] for r in run_ranks(2, train_body, cfg.model_dump(mode="json"))]
    assert len(losses[0]) == 2 and losses[0] == losses[1]


@pytest.mark.slow
def test_the_chosen_plan_of_an_moe_model_runs_under_behemoth_train(tmp_path, capsys):
    """The unpinned plan's YAML, run by the command itself: `behemoth train --nproc 2 --config plan.yaml`."""
    from behemoth.cli import main

    out_file, _ = plan_file(tmp_path, capsys)
    plan = yaml.safe_load(out_file.read_text())["parallel"]
    assert main(["train", "--nproc", "2", "--config", str(out_file), "train.steps=2", f"run.dir={tmp_path / 'run'}"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("behemoth: gpt-moe-tiny"))
    assert f"dp={plan.get('dp', 1)}" in line or f"pp={plan.get('pp', 1)}" in line, (plan, line)
    assert (tmp_path / "run" / "metrics.jsonl").exists()
