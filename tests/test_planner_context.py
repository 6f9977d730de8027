"""Context parallelism in the planner: the memory it predicts for cp plans against the engine's measured peak, its
enumeration never proposing a combination the runtime refuses, the search against brute force, and a long-sequence
case where memory binds: the search picks cp over tp and pp, and the YAML `behemoth plan` writes trains the
single-process curve on 2 ranks."""

from __future__ import annotations

import json

import pytest
import yaml

from behemoth.config import load_config
from behemoth.planner.cluster import load_cluster
from behemoth.planner.layout import Layout, Offload, Workload
from behemoth.planner.search import Space, enumerate_layouts, refusals, search
from tests.test_planner_memory import mismatches
from tests.test_planner_search_dims import DENSE, SCHEDULES, optimum, small_cluster

CP_TOLERANCE = 0.02  # the cp rows are predicted within 1.3%; without the ring's backward buffers the wide one is 4% under
WIDE = ("model.n_layer=2", "model.d_model=512", "model.n_head=8", "model.context=512", "train.seq_len=512", "train.global_batch=2")
CP_GRID = {
    2: [
        ("parallel.cp=2", "parallel.cp_mode=ring"),
        ("parallel.cp=2", "parallel.cp_mode=ulysses", "parallel.recompute=full", "parallel.zero_stage=1"),
        ("parallel.cp=2", "parallel.cp_mode=ring", "parallel.zero_stage=3", *WIDE),
    ],
}
SLOW_CP_GRID = {
    2: [("parallel.cp=2", "parallel.cp_mode=ulysses", "parallel.zero_stage=3", *WIDE), ("parallel.cp=2", "parallel.cp_mode=ring", *WIDE)],
    4: [
        ("parallel.cp=4", "parallel.cp_mode=ring"),
        ("parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp_mode=ulysses"),
        ("parallel.cp=2", "parallel.zero_stage=3", "parallel.cp_mode=ring"),
        ("parallel.cp=2", "parallel.pp=2", "parallel.microbatches=2", "parallel.cp_mode=ring"),
        ("parallel.cp=2", "parallel.pp=2", "parallel.microbatches=4", "parallel.cp_mode=ulysses", "parallel.schedule=gpipe"),
    ],
}
LONG = ["model=gpt-1m", "model.context=2048", "train.global_batch=1", "train.seq_len=2048"]


@pytest.mark.parametrize("world", sorted(CP_GRID))
def test_predicted_memory_of_cp_plans_matches_measured(world, tmp_path):
    assert mismatches(world, CP_GRID[world], tmp_path, CP_TOLERANCE) == []


@pytest.mark.slow
@pytest.mark.parametrize("world", sorted(SLOW_CP_GRID))
def test_predicted_memory_of_cp_plans_matches_measured_wider_grid(world, tmp_path):
    assert mismatches(world, SLOW_CP_GRID[world], tmp_path, CP_TOLERANCE) == []


def test_a_cp_layout_round_trips_through_the_plan_a_user_writes():
    cfg = load_config(None, [*DENSE, "parallel.cp=2", "parallel.cp_mode=ring", "parallel.zero_stage=3"])
    lay = Layout.of_config(cfg, 4)
    assert (lay.dp, lay.cp, lay.cp_mode, lay.shard_ranks, lay.tokens(cfg.seq_len)) == (2, 2, "ring", 4, cfg.seq_len // 2 * lay.micro_batch)
    plan = lay.to_plan(cfg.parallel)
    assert (plan.cp, plan.cp_mode, plan.dims(4).dp) == (2, "ring", 2)


@pytest.mark.parametrize("preset", [DENSE, ["model=gpt-moe-tiny", "train.global_batch=8", "train.seq_len=32"]])
def test_no_enumerated_cp_layout_is_one_the_runtime_refuses(preset):
    """Every layout the search may propose with cp > 1 passes `problems()` (cp with offload, or with experts routed
    under a capacity or noisy gating, is refused there: none is enumerated); a dense model gets cp layouts of both
    attentions, under a pipeline too, and a dropless MoE model cp layouts with and without ep."""
    cfg = load_config(None, preset)
    work, cluster = Workload.of(cfg), small_cluster(1.0)
    layouts = enumerate_layouts(work, 4, Space(**SCHEDULES), cluster)
    cp = [lay for lay in layouts if lay.cp > 1]
    assert {(lay.cp, lay.cp_mode) for lay in cp} >= {(2, "ring"), (2, "ulysses"), (4, "ring")}
    assert any(lay.pp == 2 for lay in cp) and not any(lay.offload.enabled for lay in cp)
    assert {lay.ep for lay in cp} == ({1, 2} if any(work.census.shape.experts) else {1})
    assert [lay.describe() for lay in cp if refusals(cfg, lay, 4)] == []


@pytest.mark.parametrize("memory_gb", [1.0, 0.0009])
def test_search_finds_the_brute_force_optimum_with_context_parallelism(memory_gb):
    """A dense model of 2 sequences on 4 devices: cp in {1, 2, 4} beside dp, tp and pp; the search's best is the
    brute-force best over every layout, recompute set and stage boundary."""
    cfg = load_config(None, ["model=gpt-tiny", "model.n_layer=2", "model.context=64", "train.global_batch=2", "train.seq_len=64"])
    cluster, space = small_cluster(memory_gb), Space(**SCHEDULES)
    best, everything = optimum(cfg, 4, cluster, space)
    assert {c.layout.cp for c in everything} == {1, 2, 4}
    found = search(Workload.of(cfg), cluster, 4, space, cfg=cfg, exact=0).ranked[0]
    assert found.step_seconds == pytest.approx(best.step_seconds, rel=1e-9), (found.layout.describe(), best.layout.describe())


def long_sequence_cluster(tmp_path):  # type: ignore[no-untyped-def]
    """A100 figures for 2 devices of 30 MB: a 2048-token sequence of gpt-1m needs recomputation to fit any layout."""
    cluster = load_cluster("a100-80gb").model_copy(update={"devices_per_node": 2})
    cluster = cluster.model_copy(update={"device": cluster.device.model_copy(update={"memory_gb": 0.03, "reserved_gb": 0.0})})
    path = tmp_path / "cluster.yaml"
    path.write_text(cluster.to_yaml())
    return path, cluster


def long_sequence_plan(tmp_path, capsys) -> tuple:  # type: ignore[no-untyped-def]
    """`behemoth plan --cluster FILE --world 2 --out plan.yaml` for one 2048-token sequence; the YAML's config, the
    cluster and the options every run of it shares."""
    from behemoth.cli import main

    path, cluster = long_sequence_cluster(tmp_path)
    common = [*LONG, "train.steps=2", "train.eval_every=0", "checkpoint.every=0", "run.progress=false", f"data.cache_dir={tmp_path / 'c'}"]
    out_file = tmp_path / "plan.yaml"
    assert main(["plan", "--cluster", str(path), "--world", "2", "--out", str(out_file), *common]) == 0
    assert "cp=2" in capsys.readouterr().out
    assert yaml.safe_load(out_file.read_text())["parallel"]["cp"] == 2
    return load_config(str(out_file), [f"run.dir={tmp_path / 'run'}"]), cluster.with_nodes(2), common, out_file


def test_a_long_sequence_is_planned_context_parallel_and_its_yaml_trains(tmp_path, capsys):
    """One 2048-token sequence per step on 2 devices where memory binds: no data parallelism is possible, and the
    search's plan is cp=2, faster than the best tp or pp plan (the search with cp pinned to 1); the YAML `behemoth plan
    --out` writes passes every check `behemoth train` makes before launch and trains 2 steps on 2 ranks."""
    from behemoth.planner.feasibility import launch_problems
    from tests.common import train_body
    from tests.dist import run_ranks

    cfg, cluster, _, _ = long_sequence_plan(tmp_path, capsys)
    work = Workload.of(cfg)
    chosen = search(work, cluster, 2, Space(), cfg=cfg).ranked[0]
    assert chosen.layout.cp == 2 and chosen.layout.recompute  # memory binds: it fits only recomputing
    on_devices = (Offload(),)  # a streamed (offloaded) pipeline fits without recomputing; on the devices nothing does
    assert search(work, cluster, 2, Space(recompute=False, offload=on_devices), cfg=cfg).ranked == []
    flat = search(work, cluster, 2, Space(cp=(1,)), cfg=cfg).ranked
    assert flat and all(c.layout.tp > 1 or c.layout.pp > 1 for c in flat)
    assert chosen.step_seconds < flat[0].step_seconds, (chosen.layout.describe(), flat[0].layout.describe())
    assert launch_problems(cfg, 2, None) == []
    losses = [r["losses"] for r in run_ranks(2, train_body, cfg.model_dump(mode="json"))]
    assert len(losses[0]) == 2 and losses[0] == losses[1] and all(0 < x < 10 for x in losses[0])


@pytest.mark.slow
def test_the_long_sequence_plan_runs_under_behemoth_train_on_the_single_process_curve(tmp_path, capsys):
    """The plan's YAML run by the command itself, `behemoth train --nproc 2 --config plan.yaml`: its losses equal the
    single-process run's of the same model and batch."""
    from behemoth.cli import main
    from tests.common import train_body
    from tests.dist import run_ranks

    cfg, _, common, out_file = long_sequence_plan(tmp_path, capsys)
    assert main(["train", "--nproc", "2", "--config", str(out_file), f"run.dir={tmp_path / 'run'}"]) == 0
    assert "cp=2" in next(x for x in capsys.readouterr().out.splitlines() if x.startswith("behemoth: gpt-1m"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    got = [r["loss"] for r in rows if "loss" in r]
    single = load_config(None, [*common, f"run.dir={tmp_path / 'one'}"])
    single.prepare_corpus(progress=False)
    want = run_ranks(1, train_body, single.model_dump(mode="json"))[0]["losses"]
    assert got == pytest.approx(want, rel=1e-5), (got, want)
