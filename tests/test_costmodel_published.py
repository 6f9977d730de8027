"""The published training runs the cost model is validated against (benchmarks/published/*.yaml): they load, carry
their sources, price through the planner, and rank by the planner's Spearman correlation."""

from __future__ import annotations

import math

import pytest


def test_published_rows_load_price_and_rank():
    from behemoth.planner.published import load_sources, spearman, validate

    sources = load_sources()
    rows = [r for s in sources for r in s["rows"]]
    assert len(sources) >= 3 and len(rows) >= 15
    assert all(s["source"] and s["url"] for s in sources) and all(r.get("where") for r in rows)
    priced = validate(names={"GPT-1.7B", "Llama3-8B sel-op", "BLOOM-176B"})
    assert len(priced) == 3
    for r in priced:
        assert 0.5 < r.ratio < 2.0, (r.name, r.ratio)
    assert spearman([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 40.0, 30.0]) == pytest.approx(0.8)
    assert spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == pytest.approx(-1.0)
    assert spearman([1.0, 1.0, 2.0], [1.0, 2.0, 3.0]) == pytest.approx(math.sqrt(3) / 2)


def test_the_a100_sustained_clock_is_the_fit_to_its_rows_alone():
    """The one number fitted to published runs is the fit it says it is (the MosaicML A100 80GB rows, re-fitted here),
    it moves every product's and flash kernel's rate but not the rated peak MFU is counted against, and a device
    without it (a calibration, the H100 preset) runs at its rated rate."""
    from behemoth.planner.cluster import load_cluster
    from behemoth.planner.published import FIT_FILES, fit_sustained_clock, validate

    a100, h100 = load_cluster("a100-80gb").device, load_cluster("h100-sxm").device
    assert fit_sustained_clock() == pytest.approx(a100.sustained_clock, abs=0.003)
    assert FIT_FILES <= {s for s in a100.sustained_source.replace("/", " ").split() if s.endswith(".yaml")}
    assert a100.peak_rate("bf16") == pytest.approx(a100.peak("bf16") * a100.sustained_clock)
    assert h100.sustained_clock == 1.0 and h100.peak_rate("bf16") == h100.peak("bf16")
    fitted = validate(files=set(FIT_FILES))
    slower = validate(files=set(FIT_FILES), device={"sustained_clock": a100.sustained_clock - 0.1})
    assert all(s.predicted < r.predicted for s, r in zip(slower, fitted))
    assert math.exp(sum(math.log(r.ratio) for r in fitted) / len(fitted)) == pytest.approx(1.0, abs=0.01)


def test_behemoth_plan_states_the_curve_and_the_fitted_clock_with_their_sources():
    from behemoth.cli.plan import assumptions
    from behemoth.config import load_config
    from behemoth.planner.cluster import load_cluster
    from behemoth.planner.cost import price
    from behemoth.planner.layout import Layout, Workload

    cluster = load_cluster("a100-80gb").with_nodes(8)
    work = Workload.of(load_config(None, ["model=gpt-1m", "train.global_batch=8", "train.seq_len=64"]))
    said = assumptions([price(work, Layout(8, 1, 1, 0, False, 1, 1, "1f1b", 1, ()), cluster)], work, cluster)
    dev = cluster.device
    assert f"ceiling {dev.gemm.ceiling:.3g}, half {dev.gemm.half:.3g}: {dev.gemm.source}" in said
    assert f"x {dev.sustained_clock:.3g} sustained clock ({dev.sustained_source})" in said
    h100 = load_cluster("h100-sxm")
    assert "sustained clock" not in assumptions([price(work, Layout(8, 1, 1, 0, False, 1, 1, "1f1b", 1, ()), h100)], work, h100)


OUTSIDE_10_PERCENT = {  # rows the model does not bring within 10%, with the band each is held to (docs/planner.md says why)
    "MPT-3B x64": (1.0, 1.13),
    "MPT-3B x128": (1.0, 1.13),
    "MT-NLG-530B x280 nodes": (1.1, 1.3),
    "MT-NLG-530B x350 nodes": (1.1, 1.3),
    "MT-NLG-530B x420 nodes": (1.1, 1.3),
}


def test_every_published_row_is_within_10_percent_but_the_five_named():
    """What the cost model holds against the 33 published rows (docs/planner.md, "Validation against published runs"):
    every row but the five named within 10% of its published throughput (those five within their bands), the rank
    correlation at least 0.99, and each source that compares layouts of one model has its winner reproduced. A cost
    that regresses moves some row out of its band."""
    from behemoth.planner.published import comparisons, spearman, validate

    rows = validate()
    assert len(rows) == 33
    for r in rows:
        lo, hi = OUTSIDE_10_PERCENT.get(r.name, (0.9, 1.1))
        assert lo <= r.ratio <= hi, (r.name, round(r.ratio, 3), (lo, hi))
    assert spearman([r.published for r in rows], [r.predicted for r in rows]) >= 0.99
    compared = comparisons(rows=rows)
    assert len(compared) == 2 and all(published == predicted for _, published, predicted in compared), compared
