"""A plan's step as a dataflow graph: one node per action of the pipeline schedule (every rank's passes, sends,
receives, gradient syncs and optimizer step), in lanes by rank, with three kinds of edge:

    order    each rank's consecutive actions (a rank runs its list in order)
    message  a send to the receive that takes its tensor (the validator's matching: payload, stage, micro-batch, ranks)
    data     a stage's forward of a micro-batch to its backward (the stashed activations), input- to weight-gradient

A collective (Chimera's gradient sync between a stage's two replicas) is a `sync` pair: both ranks must arrive, so
the two nodes act as one; the graph is acyclic exactly when it is with each pair merged (a cycle would be a
deadlock, which the schedule's validator already excludes). Durations come from the planner's pass costs (or unit
slots); the critical path is the longest path by duration. Drawn with matplotlib as SVG, or as HTML embedding it.
"""

from __future__ import annotations

import io
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from behemoth.parallel.pipeline.analysis.simulate import Costs, run_timeline, unit_slot
from behemoth.parallel.pipeline.schedules import BACKWARDS, COMPUTE, RECVS, SENDS, Kind, Schedule

Node = tuple[int, int]  # (rank, index in the rank's action list)


@dataclass
class StepGraph:
    schedule: Schedule
    edges: dict[str, list[tuple[Node, Node]]] = field(default_factory=lambda: defaultdict(list))
    syncs: list[tuple[Node, Node]] = field(default_factory=list)
    duration: dict[Node, float] = field(default_factory=dict)
    start: dict[Node, float] = field(default_factory=dict)

    @property
    def nodes(self) -> list[Node]:
        return [(r, i) for r, actions in enumerate(self.schedule.per_rank) for i in range(len(actions))]

    def action(self, n: Node) -> Any:
        return self.schedule.per_rank[n[0]][n[1]]

    def all_edges(self) -> list[tuple[Node, Node]]:
        return [e for kind in ("order", "message", "data") for e in self.edges[kind]]


def step_graph(schedule: Schedule, costs: Costs | None = None) -> StepGraph:
    """The schedule's DAG, with each action's duration and simulated start under `costs` (None: unit slots)."""
    g = StepGraph(schedule)
    sends: dict[tuple, Node] = {}
    recvs: dict[tuple, Node] = {}
    forwards: dict[tuple, Node] = {}
    inputs: dict[tuple, Node] = {}
    syncs: dict[tuple, Node] = {}
    for r, actions in enumerate(schedule.per_rank):
        for i, a in enumerate(actions):
            if i:
                g.edges["order"].append(((r, i - 1), (r, i)))
            if a.kind in SENDS:
                sends[(SENDS[a.kind], a.stage, a.microbatch, r, a.peer)] = (r, i)
            elif a.kind in RECVS:
                recvs[(a.kind, a.stage, a.microbatch, a.peer, r)] = (r, i)
            elif a.kind is Kind.FORWARD:
                forwards[(a.stage, a.microbatch)] = (r, i)
            elif a.kind is Kind.GRAD_SYNC and a.peer is not None:
                pair = (a.stage, min(r, a.peer), max(r, a.peer))
                if pair in syncs:
                    g.syncs.append((syncs.pop(pair), (r, i)))
                else:
                    syncs[pair] = (r, i)
            if a.kind in BACKWARDS:
                g.edges["data"].append((forwards[(a.stage, a.microbatch)], (r, i)))
                inputs[(a.stage, a.microbatch)] = (r, i)
            elif a.kind is Kind.BACKWARD_WEIGHT:
                g.edges["data"].append((inputs[(a.stage, a.microbatch)], (r, i)))
    g.edges["message"] = [(node, recvs[key]) for key, node in sends.items()]
    timeline = run_timeline(schedule, costs)
    for lane in timeline:
        for iv in lane:
            g.start[(iv.rank, iv.index)] = iv.start
            g.duration[(iv.rank, iv.index)] = costs.of(iv.action) if costs is not None else unit_slot(iv.action)
    return g


def merged(g: StepGraph) -> dict[Node, Node]:
    """Each node's representative once every sync pair is merged into one node."""
    rep = {n: n for n in g.nodes}
    for a, b in g.syncs:
        rep[b] = a
    return rep


def topological_order(g: StepGraph) -> list[Node]:
    """The merged graph's nodes in an order every edge respects; ValueError naming a node on a cycle if there is one."""
    rep = merged(g)
    succ: dict[Node, list[Node]] = defaultdict(list)
    indeg = {n: 0 for n in set(rep.values())}
    for u, v in g.all_edges():
        ru, rv = rep[u], rep[v]
        if ru != rv:
            succ[ru].append(rv)
            indeg[rv] += 1
    ready = sorted(n for n, d in indeg.items() if d == 0)
    order = []
    while ready:
        n = ready.pop()
        order.append(n)
        for m in succ[n]:
            indeg[m] -= 1
            if indeg[m] == 0:
                ready.append(m)
    if len(order) != len(indeg):
        stuck = min(n for n, d in indeg.items() if d > 0)
        raise ValueError(f"the step graph of {g.schedule.name} has a cycle through rank {stuck[0]} action {stuck[1]}")
    return order


def critical_path(g: StepGraph) -> list[Node]:
    """The longest path by duration through the merged graph (its representatives), first node first."""
    rep = merged(g)
    preds: dict[Node, list[Node]] = defaultdict(list)
    for u, v in g.all_edges():
        if rep[u] != rep[v]:
            preds[rep[v]].append(rep[u])
    best: dict[Node, tuple[float, Node | None]] = {}
    for n in topological_order(g):
        before = max(((best[p][0], p) for p in preds[n]), default=(0.0, None))
        best[n] = (before[0] + g.duration.get(n, 0.0), before[1])
    node: Node | None = max(best, key=lambda n: best[n][0])
    path = []
    while node is not None:
        path.append(node)
        node = best[node][1]
    return path[::-1]


def draw_svg(g: StepGraph, title: str) -> str:
    """The drawing as SVG text (`draw`)."""
    return draw(g, title, "svg").decode()


def draw(g: StepGraph, title: str, fmt: str = "svg") -> bytes:
    """Lanes by rank, each action at its simulated start, coloured by duration; messages as arrows, the critical path
    outlined in red; as SVG or PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    crit = set(critical_path(g))
    longest = max(g.duration.values(), default=1.0) or 1.0
    end = max((g.start[n] + g.duration[n] for n in g.nodes), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(min(40, 4 + len(g.nodes) / 6), 1.2 + 0.9 * g.schedule.ranks))
    cmap = plt.get_cmap("YlGnBu")
    compute = {g.duration[n] for n in g.nodes if g.action(n).kind in COMPUTE}
    by_kind = {Kind.FORWARD: "#8ecae6", Kind.BACKWARD: "#90be6d", Kind.BACKWARD_INPUT: "#90be6d", Kind.BACKWARD_WEIGHT: "#43aa8b"}
    tick = end / 200
    for n in g.nodes:
        a, x, w = g.action(n), g.start[n], max(g.duration[n], tick)
        if a.kind not in COMPUTE:
            colour: Any = "0.75"
        else:  # by duration when the passes differ, else by kind
            colour = cmap(0.2 + 0.7 * g.duration[n] / longest) if len(compute) > 1 else by_kind[a.kind]
        edge = "red" if n in crit else "black"
        ax.add_patch(plt.Rectangle((x, n[0] - 0.35), w, 0.7, facecolor=colour, edgecolor=edge, lw=2.0 if n in crit else 0.4))
        if a.kind in COMPUTE:
            ax.text(x + w / 2, n[0], a.label, ha="center", va="center", fontsize=7)
    for u, v in g.edges["message"]:
        ax.annotate("", xy=(g.start[v], v[0]), xytext=(g.start[u] + g.duration[u], u[0]), arrowprops={"arrowstyle": "->", "lw": 0.5, "color": "0.3"})
    for u, v in g.syncs:
        ax.plot([g.start[u], g.start[v]], [u[0], v[0]], ls="--", color="orange", lw=0.8)
    ax.set_xlim(0, end * 1.02)
    ax.set_ylim(g.schedule.ranks - 0.5, -0.5)
    ax.set_yticks(range(g.schedule.ranks), [f"rank {r}" for r in range(g.schedule.ranks)])
    ax.set_xlabel("simulated time (s)" if len(compute) > 1 or longest != 1.0 else "simulated time (unit slots: every pass 1)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format=fmt, dpi=110)
    plt.close(fig)
    return out.getvalue()


def to_html(g: StepGraph, title: str) -> str:
    """The SVG in a page, with the graph's counts and its critical path listed."""
    counts = ", ".join(f"{len(v)} {k}" for k, v in g.edges.items())
    path = " -> ".join(f"r{n[0]}:{g.action(n).label}" for n in critical_path(g))
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head><body>"
        f"<h3>{title}</h3><p>{len(g.nodes)} actions; edges: {counts}; {len(g.syncs)} sync pairs</p>"
        f"{draw_svg(g, title)}<p>critical path: {path}</p></body></html>"
    )
