"""The table `behemoth profile` prints: seconds and percent of a step per component, measured beside the planner's
prediction for the same plan, the differential runs' steps, and the largest disagreement named.

Measured components are the mean over ranks of each rank's mean over its steps (`stall.summarize`), so they add up to
the mean step (the percentages are of that mean). The planner models compute, communication, the bubble, the
optimizer and offload traffic; it does not model data preparation, checkpoints or the host's own work (shown as `-`).
Its forward and backward split the passes' compute 1:2 (its backward = input gradient + weight gradient, each a
forward's worth), recomputation in backward.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from behemoth.profiler.energy import energy_line
from behemoth.profiler.stall import RUNS, summarize

ROWS = (
    ("forward", "compute: forward", ("forward",)),
    ("backward", "compute: backward (incl. recompute)", ("backward",)),
    ("optimizer", "compute: optimizer step + clipping", ("optimizer",)),
    ("comm_dp", "exposed comm: dp / ZeRO / world", ("comm_dp", "comm_dp_net")),
    ("comm_tp", "exposed comm: tensor parallel", ("comm_tp", "comm_tp_net")),
    ("comm_ep", "exposed comm: expert all-to-all", ("comm_ep", "comm_ep_net")),
    ("bubble", "pipeline bubble + p2p waits", ("bubble", "comm_pp", "comm_pp_net")),
    ("data", "data preparation", ("data",)),
    ("checkpoint", "storage I/O: checkpoint stall", ("checkpoint",)),
    ("offload", "storage I/O: offload waits", ("offload",)),
    ("host", "host overhead", ("host",)),
)
MODELLED = ("forward", "backward", "optimizer", "comm_dp", "comm_tp", "comm_ep", "bubble", "offload")
COMM = ("comm_dp", "comm_tp", "comm_pp", "comm_ep")


@dataclass
class Profile:
    """The measured runs (per rank), the compute-only run when there is one, and the planner's step for the plan."""

    ranks: list[dict[str, Any]]
    predicted: Any = None  # planner StepTime
    compute_only: dict[str, Any] | None = None  # one rank's result of the one-process run
    plan: str = ""

    def run_names(self) -> list[str]:
        return [n for n in RUNS if n in self.ranks[0]["runs"]]

    def measured(self, run: str) -> dict[str, float]:
        """Mean over ranks of each component's per-step mean, and of the median step."""
        per_rank = [summarize(r["runs"][run]) for r in self.ranks]
        return {k: statistics.fmean(s[k] for s in per_rank) for k in per_rank[0]}

    def rows(self, run: str) -> dict[str, float]:
        m = self.measured(run)
        return {key: sum(m[c] for c in parts) for key, _, parts in ROWS}

    def predicted_rows(self) -> dict[str, float | None]:
        t = self.predicted
        if t is None:
            return {key: None for key, _, _ in ROWS}
        compute = max(t.passes - t.bubble - t.tp_comm - t.recompute, 0.0)
        return {
            "forward": compute / 3,
            "backward": 2 * compute / 3 + t.recompute,
            "optimizer": t.optimizer,
            "comm_dp": t.dp_comm,
            "comm_tp": t.tp_comm,
            "comm_ep": t.ep_comm,
            "bubble": t.bubble,
            "offload": t.offload,
            "checkpoint": None,
            "data": None,
            "host": None,
        }

    def calibration(self, cluster: str | None) -> dict[str, Any]:
        """What `behemoth recommend --calibrate` reads: the measured and predicted rows of the fullest run without a
        checkpoint every step (`data`, else `synthetic`), its mean step, and the hardware the prediction was made for."""
        names = self.run_names()
        run = next((n for n in ("data", "synthetic") if n in names), names[-1])
        return {
            "cluster": cluster or "local",
            "plan": self.plan,
            "run": run,
            "step": self.measured(run)["step_mean"],
            "measured": self.rows(run),
            "predicted": self.predicted_rows(),
        }

    def links(self, run: str) -> tuple[float, float]:
        """(intra-node, inter-node) seconds of exposed collective communication per step (pipeline transfers are in the
        bubble, not here)."""
        m = self.measured(run)
        return sum(m[c] for c in COMM), sum(m[f"{c}_net"] for c in COMM)

    def differential(self) -> dict[str, float]:
        """What each run adds to the run before it (median steps): exposed communication over the compute-only run,
        data preparation over synthetic data, storage I/O over real data."""
        steps = {n: self.measured(n)["step"] for n in self.run_names()}
        out = {}
        if self.compute_only is not None and "synthetic" in steps:
            out["comm"] = steps["synthetic"] - summarize(self.compute_only["runs"]["synthetic"])["step"]
        if "data" in steps and "synthetic" in steps:
            out["data"] = steps["data"] - steps["synthetic"]
        if "io" in steps and "data" in steps:
            out["io"] = steps["io"] - steps["data"]
        return out

    def largest_disagreement(self, run: str) -> tuple[str, float, float] | None:
        """(component, measured, predicted) with the largest absolute difference among the components the planner models."""
        pred = self.predicted_rows()
        if self.predicted is None:
            return None
        got = self.rows(run)
        key = max(MODELLED, key=lambda k: abs(got[k] - (pred[k] or 0.0)))
        return key, got[key], pred[key] or 0.0


def table(p: Profile) -> str:
    """The whole report: the runs' steps, the component table of the last (fullest) run, the disagreement."""
    names = p.run_names()
    run = names[-1]
    got, pred = p.rows(run), p.predicted_rows()
    measured = p.measured(run)
    step, mean = measured["step"], measured["step_mean"]
    lines = [f"behemoth profile: {p.plan}; {len(p.ranks)} rank(s)", "runs (median step, mean over ranks):"]
    if p.compute_only is not None:
        lines.append(f"  {'compute only (1 rank)':<24}{summarize(p.compute_only['runs']['synthetic'])['step'] * 1e3:>10.2f} ms")
    for n in names:
        lines.append(f"  {n:<24}{p.measured(n)['step'] * 1e3:>10.2f} ms")
    total_pred = p.predicted.total if p.predicted is not None else None
    lines += [
        f"where a step of the '{run}' run goes (ms; mean over ranks and steps):",
        f"  {'component':<38}{'measured':>10}{'%':>7}{'predicted':>11}{'%':>7}",
    ]
    for key, label, _ in ROWS:
        pv = pred[key]
        pred_text = f"{pv * 1e3:>11.2f}{pv / total_pred:>7.0%}" if pv is not None and total_pred else f"{'-':>11}{'':>7}"
        lines.append(f"  {label:<38}{got[key] * 1e3:>10.2f}{got[key] / mean:>7.0%}{pred_text}")
    total = sum(got.values())
    lines.append(f"  {'sum of components':<38}{total * 1e3:>10.2f}{total / mean:>7.0%}" + (f"{total_pred * 1e3:>11.2f}" if total_pred else ""))
    lines.append(f"  {'measured step (mean; median)':<38}{mean * 1e3:>10.2f}  ({step * 1e3:.2f})")
    intra, inter = p.links(run)
    node = p.ranks[0].get("node_size", len(p.ranks))
    nodes = -(-len(p.ranks) // node)
    lines.append(f"exposed comm by link ({nodes} node(s) of {node} rank(s)): intra-node {intra * 1e3:.2f} ms, inter-node {inter * 1e3:.2f} ms")
    diff = p.differential()
    if diff:
        lines.append("differential (a run's step less the one before it, ms): " + ", ".join(f"{k} {v * 1e3:+.2f}" for k, v in diff.items()))
    energy = p.ranks[0]["runs"][run]["energy"]  # machine-wide counters: one rank's reading
    lines.append(energy_line(energy["joules"], len(p.ranks[0]["runs"][run]["step_s"]), energy["missing"]))
    worst = p.largest_disagreement(run)
    if worst is not None:
        key, m, q = worst
        label = next(lbl for k, lbl, _ in ROWS if k == key)
        ratio = f"{m / q:.2g}x the prediction" if q > 0 else "predicted 0"
        lines.append(f"largest disagreement with the planner: {label}: measured {m * 1e3:.2f} ms, predicted {q * 1e3:.2f} ms ({ratio})")
    return "\n".join(lines)
