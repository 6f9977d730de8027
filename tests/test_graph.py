"""`behemoth graph`: the step's DAG has exactly the schedule's actions as nodes, one order edge per consecutive pair, one
message edge per send (to its receive), one data edge per backward pass; it is acyclic (sync pairs merged), and a
cycle planted in it is found. The drawing is SVG/HTML with one box per action."""

from __future__ import annotations

from pathlib import Path

import pytest

from behemoth.parallel.pipeline.schedules import BACKWARDS, RECVS, SENDS, Kind, build_schedule
from behemoth.profiler.graph import StepGraph, critical_path, step_graph, topological_order

SCHEDULES = [("1f1b", 4, 6, 1), ("gpipe", 3, 4, 1), ("interleaved", 2, 4, 2), ("zb-h1", 4, 6, 1), ("chimera", 4, 4, 1), ("1f1b", 1, 3, 1)]


@pytest.mark.parametrize("name,p,m,v", SCHEDULES)
def test_graph_has_the_schedules_own_actions_and_dependencies(name: str, p: int, m: int, v: int) -> None:
    s = build_schedule(name, p, m, v)
    g = step_graph(s)
    actions = [a for rank in s.per_rank for a in rank]
    assert len(g.nodes) == len(actions)
    assert len(g.edges["order"]) == sum(len(r) - 1 for r in s.per_rank)
    sends = [a for a in actions if a.kind in SENDS]
    assert len(g.edges["message"]) == len(sends) == sum(a.kind in RECVS for a in actions)
    for u, w in g.edges["message"]:
        su, rv = g.action(u), g.action(w)
        assert SENDS[su.kind] is rv.kind and (su.stage, su.microbatch, su.peer, rv.peer) == (rv.stage, rv.microbatch, w[0], u[0])
    backs = sum(a.kind in BACKWARDS or a.kind is Kind.BACKWARD_WEIGHT for a in actions)
    assert len(g.edges["data"]) == backs
    assert len(g.syncs) * 2 == sum(a.kind is Kind.GRAD_SYNC for a in actions)
    order = topological_order(g)
    position = {n: i for i, n in enumerate(order)}
    rep = {b: a for a, b in g.syncs}
    for u, w in g.all_edges():
        assert position[rep.get(u, u)] < position[rep.get(w, w)]
    path = critical_path(g)
    assert sum(g.duration[n] for n in path) == pytest.approx(max(g.start[n] + g.duration[n] for n in g.nodes))  # unit slots, no p2p


def test_a_planted_cycle_is_found() -> None:
    g = step_graph(build_schedule("1f1b", 2, 2))
    last = (1, len(g.schedule.per_rank[1]) - 1)
    bad = StepGraph(g.schedule, {**g.edges, "order": [*g.edges["order"], (last, (1, 0))]}, g.syncs, g.duration, g.start)
    with pytest.raises(ValueError, match="cycle"):
        topological_order(bad)


def test_graph_command_writes_svg_and_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from behemoth.cli.graph import graph_main
    from behemoth.profiler.graph import to_html

    svg = tmp_path / "step.svg"
    args = ["--nproc", "4", "parallel.pp=4", "parallel.schedule=chimera", "train.global_batch=8", "train.micro_batch=2", "model=gpt-1m"]
    assert graph_main([*args, "--cluster", "a100-80gb", "--out", str(svg)]) == 0
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    assert "92 actions, edges: 88 order, 16 data, 24 message, 4 sync pair(s)" in capsys.readouterr().out
    html = to_html(step_graph(build_schedule("chimera", 4, 4)), "chimera")
    assert "critical path" in html and "<svg" in html
    assert graph_main(["--out", str(tmp_path / "step.png")]) == 2
