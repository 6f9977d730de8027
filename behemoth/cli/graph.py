"""`behemoth graph`: a plan's step as a dataflow graph (every rank's schedule actions, messages, data dependencies,
syncs), laid out in rank lanes at the planner's predicted times, critical path outlined; SVG or HTML
(behemoth/profiler/graph.py, docs/profiling.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from behemoth.errors import BehemothError, exit_code


def graph_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="behemoth graph",
        description="Draw one plan's training step as a DAG: nodes are schedule actions, lanes are pipeline ranks.",
        epilog="examples:\n  behemoth graph --nproc 4 parallel.pp=4 parallel.schedule=1f1b train.micro_batch=1 --out step.svg\n"
        "  behemoth graph --nproc 4 parallel.pp=4 parallel.schedule=chimera --out chimera.html",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", help="YAML config; key=value options override it")
    p.add_argument("--nproc", type=int, default=None, metavar="N", help="processes the plan runs on (default: 2 on a CPU, every GPU)")
    p.add_argument("--cluster", metavar="FILE|PRESET", help="hardware whose pass costs time the actions (default: unit slots)")
    p.add_argument("--out", required=True, metavar="FILE.svg|FILE.html", help="where to write the drawing")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config options, as for behemoth train")
    return p


def graph_main(argv: list[str] | None = None) -> int:
    return exit_code(run_graph, graph_parser().parse_args(argv))


def run_graph(args: argparse.Namespace) -> int:
    from behemoth.cli import default_nproc
    from behemoth.config import load_config
    from behemoth.parallel.pipeline.schedules import build_schedule
    from behemoth.profiler.graph import critical_path, draw_svg, step_graph, to_html

    out = Path(args.out)
    if out.suffix not in (".svg", ".html"):
        raise BehemothError(f"--out {out} is neither .svg nor .html", "name the file step.svg or step.html")
    world = args.nproc or default_nproc()
    cfg = load_config(args.config, args.overrides)
    plan = cfg.parallel
    dims = plan.dims(world)
    m = cfg.batch_layout(dims).accum
    schedule = build_schedule(plan.schedule if dims.pp > 1 else "1f1b", dims.pp, m, plan.schedule_chunks)
    costs = pass_costs(cfg, world, args.cluster) if args.cluster else None
    g = step_graph(schedule, costs)
    title = f"{schedule.name}: {dims.pp} pipeline rank(s) x {m} micro-batches ({'planner costs on ' + args.cluster if costs else 'unit slots'})"
    out.write_text(draw_svg(g, title) if out.suffix == ".svg" else to_html(g, title))
    counts = ", ".join(f"{len(v)} {k}" for k, v in g.edges.items())
    print(
        f"behemoth graph: {len(g.nodes)} actions, edges: {counts}, {len(g.syncs)} sync pair(s); critical path {len(critical_path(g))} nodes -> {out}"
    )
    return 0


def pass_costs(cfg, world: int, cluster_name: str):  # noqa: ANN001, ANN201
    """The planner's per-stage forward / input-gradient / weight-gradient seconds and p2p latency for this plan."""
    from behemoth.parallel.pipeline.analysis.simulate import Costs
    from behemoth.planner.cluster import load_cluster
    from behemoth.planner.cost import resolve_bounds
    from behemoth.planner.layout import Layout, Workload
    from behemoth.planner.steptime import pass_costs as planner_pass_costs

    work, lay = Workload.of(cfg), Layout.of_config(cfg, world)
    c = planner_pass_costs(work, lay, load_cluster(cluster_name).with_nodes(world), resolve_bounds(work, lay))
    return Costs(c.forward, c.backward, c.weight, p2p=c.p2p)


if __name__ == "__main__":
    raise SystemExit(graph_main())
