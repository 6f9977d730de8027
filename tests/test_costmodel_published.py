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
