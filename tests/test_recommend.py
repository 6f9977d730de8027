"""`behemoth recommend` on a synthetic catalog whose answer is known: a cheap instance with a fast network and a pricier
one with faster devices but slow links, for a communication-bound model. The pricier one is slower; the recommender
picks the cheap one, and its cost regret against an exhaustive search over every layout of every option is 0."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from behemoth.planner.cluster import load_cluster

MODEL = ["model=gpt2-124m", "train.global_batch=64", "train.seq_len=256", "train.precision=bf16"]
TOKENS = 2e9
SPACE_PP1 = {"pp": (1,)}  # no pipeline: the exhaustive reference prices each of a few hundred layouts in closed form


def write_catalog(tmp: Path) -> Path:
    """Two instance types built from the A100 preset: `fastnet` ($10/h) and `pricey` ($25/h, devices twice as fast,
    links a twentieth as fast)."""
    base = load_cluster("a100-80gb").model_dump(mode="json")
    fast_dev = {**base, "device": {**base["device"], "peak_tflops": {k: 2 * v for k, v in base["device"]["peak_tflops"].items()}}}
    (tmp / "slowdev.yaml").write_text(yaml.safe_dump(base))
    (tmp / "fastdev.yaml").write_text(yaml.safe_dump(fast_dev))
    common = {"devices": 4, "price_date": "2026-12-02", "price_source": "synthetic", "illustrative": True, "max_nodes": 2}
    catalog = {
        "date": "2026-12-02",
        "instances": [
            {"name": "pricey", "preset": str(tmp / "fastdev.yaml"), "interconnect_gbs": 12.0, "network_gbit": 20.0, "price_per_hour": 25.0, **common},
            {
                "name": "fastnet",
                "preset": str(tmp / "slowdev.yaml"),
                "interconnect_gbs": 240.0,
                "network_gbit": 1600.0,
                "price_per_hour": 10.0,
                **common,
            },
        ],
    }
    path = tmp / "catalog.yaml"
    path.write_text(yaml.safe_dump(catalog))
    return path


def exhaustive_best(work, inst, nodes):  # type: ignore[no-untyped-def]
    """The fastest fitting plan on `nodes` x `inst` by pricing every layout the planner enumerates (no bound, every
    pipeline simulated): the reference the search's branch and bound must match."""
    from behemoth.planner.search import Space, enumerate_layouts, fit_layout, simulated
    from behemoth.profiler.recommend import cluster_of

    cluster = cluster_of(inst, nodes)
    space = Space(**SPACE_PP1)
    priced = [fit_layout(work, lay, cluster, space) for lay in enumerate_layouts(work, cluster.world, space, cluster)]
    fits = [simulated(work, c, cluster) for c in priced if c.fits]
    return min(c.step_seconds for c in fits) if fits else None


@pytest.mark.parametrize("deadline", [None, 1e6])
def test_recommends_the_cheap_fast_network_and_regret_is_zero(tmp_path: Path, deadline: float | None) -> None:
    from behemoth.config import load_config
    from behemoth.planner.layout import Workload
    from behemoth.planner.search import Space
    from behemoth.profiler.recommend import choose, load_catalog, options

    catalog = load_catalog(write_catalog(tmp_path))
    work = Workload.of(load_config(None, MODEL))
    found = options(work, catalog, TOKENS, Space(**SPACE_PP1))
    assert {(o.instance.name, o.nodes) for o in found} == {(n, k) for n in ("pricey", "fastnet") for k in (1, 2)}
    by = {(o.instance.name, o.nodes): o for o in found}
    for k in (1, 2):  # the pricier instance, with the faster devices, is slower for this model
        assert by["pricey", k].hours > by["fastnet", k].hours
    choice, runner_up, _ = choose(found, deadline, None)
    assert choice is not None and choice.instance.name == "fastnet"
    assert runner_up is not None and runner_up.instance.name == "pricey"
    steps = math.ceil(TOKENS / work.tokens_per_step)
    reference = min(
        steps * exhaustive_best(work, inst, k) / 3600 * k * inst.price_per_hour for inst in catalog.instances for k in range(1, inst.max_nodes + 1)
    )
    assert choice.cost == pytest.approx(reference, rel=1e-9)  # regret 0


def test_deadline_forces_more_instances_and_budget_picks_the_fastest(tmp_path: Path) -> None:
    from behemoth.config import load_config
    from behemoth.planner.layout import Workload
    from behemoth.planner.search import Space
    from behemoth.profiler.recommend import choose, load_catalog, options

    found = options(Workload.of(load_config(None, MODEL)), load_catalog(write_catalog(tmp_path)), TOKENS, Space(**SPACE_PP1))
    by = {(o.instance.name, o.nodes): o for o in found}
    one, two = by["fastnet", 1], by["fastnet", 2]
    assert two.hours < one.hours
    choice, _, _ = choose(found, (one.hours + two.hours) / 2, None)
    assert (choice.instance.name, choice.nodes) == ("fastnet", 2)
    choice, _, ok = choose(found, None, max(o.cost for o in found) * 2)
    assert choice.hours == min(o.hours for o in found) and len(ok) == len(found)
    assert choose(found, min(o.hours for o in found) / 2, None)[0] is None


def test_shipped_catalog_says_its_prices_are_illustrative() -> None:
    from behemoth.profiler.recommend import CATALOG, load_catalog

    catalog = load_catalog()
    assert catalog.instances and all(i.price_date and i.price_source for i in catalog.instances)
    assert all(i.illustrative == ("illustrative" in i.price_source) for i in catalog.instances)
    assert "ILLUSTRATIVE" in CATALOG.read_text()


def test_a_profile_calibration_rescales_its_instances_and_can_change_the_choice(tmp_path: Path) -> None:
    """A profile predicted on `fastnet`'s preset that measured compute 10x and communication 2x the prediction rescales
    each part of `fastnet`'s plans by that (the other instance type is untouched), and makes `pricey` the cheaper."""
    import json

    from behemoth.config import load_config
    from behemoth.errors import BehemothError
    from behemoth.planner.layout import Workload
    from behemoth.planner.search import Space
    from behemoth.profiler.recommend import choose, load_calibration, load_catalog, options

    catalog = load_catalog(write_catalog(tmp_path))
    pred = {"forward": 1.0, "backward": 2.0, "optimizer": 1.0, "comm_dp": 0.5, "comm_tp": 0.5, "comm_ep": 0.0, "bubble": 0.0, "offload": 0.0}
    got = {**{k: 10 * v for k, v in pred.items()}, "comm_dp": 1.0, "comm_tp": 1.0, "data": 0.5, "host": 0.5, "checkpoint": 0.0}
    predicted = {**pred, "data": None, "host": None}
    entry = {"cluster": str(tmp_path / "slowdev.yaml"), "run": "data", "step": 20.0, "measured": got, "predicted": predicted}
    (tmp_path / "p.json").write_text(json.dumps({"calibration": entry}))
    cal = load_calibration(tmp_path / "p.json")
    assert (cal.compute, cal.comm, cal.unmodelled) == (10.0, 2.0, 0.05)
    work = Workload.of(load_config(None, MODEL))
    plain = {(o.instance.name, o.nodes): o for o in options(work, catalog, TOKENS, Space(**SPACE_PP1))}
    scaled = {(o.instance.name, o.nodes): o for o in options(work, catalog, TOKENS, Space(**SPACE_PP1), calibrations=(cal,))}
    for k in (1, 2):
        assert scaled["pricey", k].hours == plain["pricey", k].hours and scaled["pricey", k].calibration is None
        o = scaled["fastnet", k]
        share = o.plan.shares()
        parts = 10 * (share["compute"] + share["recompute"] + share["optimizer"] + share["bubble"])
        parts += 2 * (share["tp_comm"] + share["dp_comm"] + share["ep_comm"]) + share["offload"]
        assert o.step_seconds == pytest.approx(o.plan.step_seconds * parts / 0.95, rel=1e-12)
        assert o.hours > 2 * plain["fastnet", k].hours
    assert choose(list(plain.values()), None, None)[0].instance.name == "fastnet"
    assert choose(list(scaled.values()), None, None)[0].instance.name == "pricey"
    entry["cluster"] = "h100-sxm"
    (tmp_path / "other.json").write_text(json.dumps({"calibration": entry}))
    with pytest.raises(BehemothError, match="no catalog instance"):
        options(work, catalog, TOKENS, Space(**SPACE_PP1), calibrations=(load_calibration(tmp_path / "other.json"),))
