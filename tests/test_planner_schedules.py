"""The V-shaped (zbv, dualpipev) and shifted (1f1b-scp) schedules in the cost model: the step and bubble the search
prices equal the schedule simulator's over their action lists at uniform per-stage costs, the closed forms for long
pipelines equal the simulator where stated, the stash counts read off the lists equal their closed form, and the
search over them finds the brute-force optimum."""

from __future__ import annotations

import pytest

from behemoth.config import load_config
from behemoth.parallel.pipeline.analysis.simulate import Costs, simulate, stash_profile
from behemoth.parallel.pipeline.schedules import build_schedule
from behemoth.planner.footprint import steady_peaks
from behemoth.planner.layout import Layout, Workload
from behemoth.planner.pipetime import PassCosts, closed_form_step, closed_listed_step
from behemoth.planner.search import Space, search
from tests.test_planner_search_dims import optimum, small_cluster

LISTED = ("zbv", "dualpipev", "1f1b-scp")
PASSES = [(1.0, 1.0, 1.0), (1.0, 1.3, 0.7), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0), (0.8, 2.5, 0.4)]  # (forward, input grad, weight)


def chunks(name: str) -> int:
    return 1 if name == "1f1b-scp" else 2


@pytest.mark.parametrize("name", LISTED)
def test_priced_bubble_equals_the_simulated_one(name):
    """`closed_form_step` (what the search prices every candidate by) against `simulate` of the action lists: the same
    step and bubble fraction for every p, m and per-pass costs, p2p latency included."""
    for p in (2, 3, 4):
        for m in (2 * p, 2 * p + 3, 4 * p):
            schedule = build_schedule(name, p, m, chunks(name))
            n = p * chunks(name)
            for f, b, w in PASSES:
                for p2p in (0.0, 0.3):
                    sim = simulate(schedule, Costs(f, b, w, p2p=p2p))
                    lay = Layout(pp=p, microbatches=m, schedule=name, chunks=chunks(name))
                    costs = PassCosts((f,) * n, (b,) * n, (w,) * n, p2p, 0.0, 0.0)
                    step, bubble = closed_form_step(lay, [chunks(name) * (f + b + w)] * p, costs)
                    assert step == pytest.approx(sim.step_time, rel=1e-9), (p, m, f, b, w, p2p)
                    assert bubble / step == pytest.approx(sim.bubble_fraction, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("name", ["zbv", "1f1b-scp"])
def test_long_pipeline_closed_forms_equal_the_simulator_where_stated(name):
    """ZBV's 2m(f+b+w) + (p-1)max(f,b) + (p-2)max(f-b,0) for m >= 2p-1, w >= f; 1f1b-scp's m(2f+B) + (p-1)(f+B) - 3f."""
    for p in (2, 4, 6):
        for m in (2 * p, 5 * p):
            schedule = build_schedule(name, p, m, chunks(name))
            for f, b, w in [(1.0, 1.0, 1.0), (1.0, 1.2, 1.0), (1.0, 2.0, 1.5), (2.0, 1.0, 2.0)]:
                assert closed_listed_step(name, p, m, f, b, w)[0] == pytest.approx(simulate(schedule, Costs(f, b, w)).step_time, rel=1e-12)


@pytest.mark.parametrize("name", LISTED)
def test_stash_closed_forms_equal_the_action_lists(name):
    for p in (2, 3, 5, 8):
        for m in (2 * p, 3 * p + 1):
            listed = tuple(max(profile) for profile in stash_profile(build_schedule(name, p, m, chunks(name))))
            assert listed == steady_peaks(name, p, m), (p, m)


@pytest.mark.parametrize("memory_gb", [1.0, 0.0012])
def test_search_over_the_v_and_shifted_schedules_finds_the_brute_force_optimum(memory_gb):
    """A 4-block model on 4 devices, pipelines under 1f1b, zb-h1 and the three listed schedules: the search's best is the
    brute-force best over every layout, recompute set and stage boundary, and the listed schedules are among them."""
    cfg = load_config(None, ["model=gpt-tiny", "model.n_layer=4", "train.global_batch=8", "train.seq_len=32"])
    cluster, space = small_cluster(memory_gb), Space(schedules=("1f1b", "zb-h1", *LISTED), cp=(1,))
    best, everything = optimum(cfg, 4, cluster, space)
    assert {c.layout.schedule for c in everything if c.layout.pp > 1} >= set(LISTED)
    found = search(Workload.of(cfg), cluster, 4, space, cfg=cfg, exact=0).ranked[0]
    assert found.step_seconds == pytest.approx(best.step_seconds, rel=1e-9), (found.layout.describe(), best.layout.describe())


@pytest.mark.parametrize("p", [2, 3, 4, 6])
def test_zero_bubble_counts_equal_its_action_lists(p):
    """zb-h1's activations and deferred weight passes at each rank's peak, as the memory model counts them, are the
    schedule's own (the most activations held, and of those points the most weight passes pending), with fewer
    micro-batches than stages too: 2 on 4 stages peak at 2 held and none deferred, not the formula's 2 and 1."""
    from behemoth.planner.footprint import pending_weight_passes, stash_units

    for m in range(1, 2 * p + 2):
        lay = Layout(pp=p, microbatches=m, schedule="zb-h1")
        profile = stash_profile(build_schedule("zb-h1", p, m, 1))
        for r in range(1, p):  # the first stage never splits its backward (its deferred bytes are its output's gradient)
            held, pending, _ = max(profile[r])
            assert (stash_units(lay, r), pending_weight_passes(lay, r)) == (held, pending), (p, m, r)
