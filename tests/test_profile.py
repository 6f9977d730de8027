"""`behemoth profile` on 2 CPU ranks: the components add up to the step, and stalls injected into data loading and
into a collective land in data preparation and communication (not in compute); `--trace` writes Chrome traces that
hold behemoth's spans."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.common import tiny_config
from tests.dist import run_ranks

DATA_SLEEP_S = 0.06
COLLECTIVE_DELAY_S = 0.08
STEPS = 2


def profiled(cfg: dict[str, Any], trace_dir: str) -> dict[str, Any]:
    """One rank: the profile as measured, then the data run again with the injected stalls."""
    import torch.distributed as dist

    from behemoth.data import BatchSampler
    from behemoth.profiler.stall import profile_worker

    base = profile_worker(cfg, STEPS, 1, ("synthetic", "data", "io"), trace_dir)
    two_nodes = profile_worker(cfg, 1, 0, ("synthetic",), node_size=1)  # each rank its own node: every dp collective crosses
    plain_sample, plain_reduce = BatchSampler.micro_batches, dist.all_reduce
    calls = {"all_reduce": 0, "micro_batches": 0}

    def slow_sample(self: Any, step: int) -> Any:
        calls["micro_batches"] += 1
        time.sleep(DATA_SLEEP_S)
        return plain_sample(self, step)

    def slow_reduce(*args: Any, **kwargs: Any) -> Any:
        calls["all_reduce"] += 1
        time.sleep(COLLECTIVE_DELAY_S)
        return plain_reduce(*args, **kwargs)

    BatchSampler.micro_batches, dist.all_reduce = slow_sample, slow_reduce
    try:
        stalled = profile_worker(cfg, STEPS, 1, ("data",))
    finally:
        BatchSampler.micro_batches, dist.all_reduce = plain_sample, plain_reduce
    return {"base": base, "stalled": stalled, "calls": calls, "two_nodes": two_nodes}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("profile")
    cfg = tiny_config(tmp / "run", "train.micro_batch=2")
    return run_ranks(2, profiled, cfg, str(tmp / "trace"), timeout=240)


def test_components_add_up_to_the_step(results: list[dict[str, Any]]) -> None:
    from behemoth.profiler.stall import summarize

    for r in results:
        for name, run in r["base"]["runs"].items():
            s = summarize(run)
            parts = sum(v for k, v in s.items() if not k.startswith("step"))
            assert parts == pytest.approx(s["step_mean"], rel=0.05), (r["base"]["rank"], name, s)
            assert min(s["forward"], s["backward"], s["optimizer"], s["comm_dp"]) > 0, (name, s)
        assert summarize(r["base"]["runs"]["io"])["checkpoint"] > 0


def test_injected_stalls_land_where_they_were_put(results: list[dict[str, Any]]) -> None:
    from behemoth.profiler.stall import summarize

    for r in results:
        base, stalled = summarize(r["base"]["runs"]["data"]), summarize(r["stalled"]["runs"]["data"])
        steps = 1 + STEPS
        reduces = r["calls"]["all_reduce"] // steps  # at least, per step: the gradient buckets, the norm (the loss's, some steps)
        assert r["calls"]["micro_batches"] == steps and reduces >= 2
        # the sleeps are charged where they were put, in full, and nowhere else: the machine's noise is smaller than them
        assert base["data"] < 0.2 * DATA_SLEEP_S and stalled["data"] >= 0.95 * DATA_SLEEP_S, (base, stalled)
        delay = reduces * COLLECTIVE_DELAY_S
        assert stalled["comm_dp"] >= 0.95 * delay > base["comm_dp"], (base, stalled, reduces)
        # and nothing else lands in data: not a collective's delay (a sleep may overrun on a loaded machine, by less)
        assert stalled["data"] < DATA_SLEEP_S + base["data"] + 0.5 * COLLECTIVE_DELAY_S, (base, stalled)


def test_communication_is_split_by_link(results: list[dict[str, Any]]) -> None:
    """On one node every collective is intra-node; with one rank per node the same data-parallel traffic is all
    inter-node (the `_net` components), and the report's link line says so."""
    from behemoth.profiler.report import Profile, table
    from behemoth.profiler.stall import summarize

    for r in results:
        one, two = summarize(r["base"]["runs"]["synthetic"]), summarize(r["two_nodes"]["runs"]["synthetic"])
        assert one["comm_dp"] > 0 and one["comm_dp_net"] == 0, one
        assert two["comm_dp_net"] > 0 and two["comm_dp"] == 0, two
    split = Profile([r["two_nodes"] for r in results], plan="dp=2")
    intra, inter = split.links("synthetic")
    assert intra == 0 and inter > 0
    assert "exposed comm by link (2 node(s) of 1 rank(s)): intra-node 0.00 ms" in table(split)


def test_profile_result_calibrates_recommend(results: list[dict[str, Any]], tmp_path: Path) -> None:
    """The calibration a profile writes is what `recommend --calibrate` reads: its compute factor is the measured
    compute over the predicted, its unmodelled share the data preparation and host work of the measured step."""
    from behemoth.config import Config
    from behemoth.planner.cluster import load_cluster
    from behemoth.planner.cost import price
    from behemoth.planner.layout import Layout, Workload
    from behemoth.profiler.recommend import load_calibration
    from behemoth.profiler.report import Profile

    cfg = Config.model_validate(tiny_config("unused", "train.micro_batch=2"))
    predicted = price(Workload.of(cfg), Layout.of_config(cfg, 2), load_cluster("a100-80gb").with_nodes(2), exact=True).time
    profile = Profile([r["base"] for r in results], predicted, plan="dp=2")
    entry = profile.calibration("a100-80gb")
    (tmp_path / "p.json").write_text(json.dumps({"calibration": entry}))
    cal = load_calibration(tmp_path / "p.json")
    got, pred = profile.rows("data"), profile.predicted_rows()
    compute = sum(got[k] for k in ("forward", "backward", "optimizer")) / sum(pred[k] or 0.0 for k in ("forward", "backward", "optimizer"))
    assert entry["run"] == "data" and cal.cluster == "a100-80gb"
    assert cal.compute == pytest.approx(compute) and cal.compute > 1  # a CPU is slower than the A100 the model assumed
    assert cal.unmodelled == pytest.approx((got["data"] + got["host"]) / profile.measured("data")["step_mean"])


def test_report_names_the_largest_disagreement(results: list[dict[str, Any]]) -> None:
    from behemoth.config import Config
    from behemoth.planner.cluster import load_cluster
    from behemoth.planner.cost import price
    from behemoth.planner.layout import Layout, Workload
    from behemoth.profiler.report import MODELLED, Profile, table

    cfg = Config.model_validate(tiny_config("unused", "train.micro_batch=2"))
    predicted = price(Workload.of(cfg), Layout.of_config(cfg, 2), load_cluster("a100-80gb").with_nodes(2), exact=True).time
    profile = Profile([r["base"] for r in results], predicted, plan="dp=2")
    text = table(profile)
    key, measured, pred = profile.largest_disagreement("io")
    assert key in MODELLED
    gaps = {k: abs(profile.rows("io")[k] - (profile.predicted_rows()[k] or 0.0)) for k in MODELLED}
    assert gaps[key] == max(gaps.values())
    assert "largest disagreement with the planner" in text and "data preparation" in text
    assert profile.differential().keys() == {"data", "io"}


def test_trace_is_chrome_json_with_behemoths_spans(results: list[dict[str, Any]]) -> None:
    for r in results:
        trace = json.loads(Path(r["base"]["trace"]).read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        ours = {n for n in names if n.startswith("behemoth/")}
        assert {"behemoth/step 0", "behemoth/step 1", "behemoth/forward_backward", "behemoth/backward", "behemoth/optimizer step"} <= ours
        assert any(n in ("behemoth/all_reduce on dp", "behemoth/all_reduce on world") for n in ours), ours
        assert any(n.startswith("behemoth/wait all_reduce #") for n in ours), ours
        spans = [e for e in trace["traceEvents"] if e.get("name", "").startswith("behemoth/") and e.get("ph") == "X"]
        assert all(e["dur"] >= 0 and "ts" in e for e in spans)
        assert trace["behemoth_clock"]["rank"] == r["base"]["rank"]


@pytest.mark.slow
@pytest.mark.parametrize("plan", ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2"])
def test_profile_command_on_each_dimension(plan: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`behemoth profile` end to end (elastic launch, the one-process run, the prediction): each dimension's traffic
    lands in its own row. Slow: three launches (`pytest -m slow tests/test_profile.py`)."""
    from behemoth.cli.profile import profile_main
    from tests.common import CACHE

    args = ["--nproc", "2", "--steps", "2", "--json", str(tmp_path / "p.json"), plan, "model=gpt-tiny", "train.global_batch=8"]
    assert profile_main([*args, "train.seq_len=32", "train.micro_batch=2", f"data.cache_dir={CACHE}", "run.timeout_s=120"]) == 0
    out = capsys.readouterr().out
    rows = {
        line[:40].strip(): float(line[40:50]) for line in out.splitlines() if line.startswith("  ") and line[40:50].strip().replace(".", "").isdigit()
    }
    row = {
        "parallel.dp=2": "exposed comm: dp / ZeRO / world",
        "parallel.tp=2": "exposed comm: tensor parallel",
        "parallel.pp=2": "pipeline bubble + p2p waits",
    }
    assert rows[row[plan]] > 0, out
    assert "largest disagreement with the planner" in out and json.loads((tmp_path / "p.json").read_text())["ranks"]
