"""`behemoth schedule`: what every pipeline schedule costs for one configuration, before anything runs.

Prints a comparison table (step time, bubble fraction simulated and closed form, peak stashed
activations), optionally one schedule's rank x time grid, and a Gantt chart PNG. Costs are those of
one pipeline rank's share of the model (1/p of the layers) for one micro-batch; interleaving splits
that share into v chunks of 1/v the cost each, so all schedules are compared on the same model.
Runnable on its own: python -m behemoth.parallel.pipeline.analysis.report --stages 4 --microbatches 8
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from behemoth.errors import BehemothError, exit_code
from behemoth.parallel.pipeline.analysis.gantt import draw_gantt, format_grid
from behemoth.parallel.pipeline.analysis.simulate import ClosedForm, Costs, SimResult, closed_form_bubble, simulate
from behemoth.parallel.pipeline.analysis.validate import validate
from behemoth.parallel.pipeline.schedules import SCHEDULES, Schedule, ScheduleError, build_schedule, check_request, schedule_chunks


@dataclass(frozen=True)
class Comparison:
    """One schedule's row: its validated schedule and simulation, or why it cannot run this configuration."""

    name: str
    schedule: Schedule | None = None
    result: SimResult | None = None
    closed_form: ClosedForm | None = None
    skipped: str = ""


def stage_costs(name: str, chunks: int, costs: Costs) -> Costs:
    """Per-model-stage costs for `name`: a rank's share split into `chunks` stages (interleaving, the V schedules)."""
    if chunks == 1:
        return costs
    scale = lambda v: v / chunks if isinstance(v, (int, float)) else [x / chunks for x in v]  # noqa: E731
    return Costs(scale(costs.forward), scale(costs.backward), scale(costs.weight), costs.p2p, costs.grad_sync)


def compare(stages: int, microbatches: int, chunks: int, costs: Costs) -> list[Comparison]:
    """Build, validate and simulate every schedule for one configuration; skip those it cannot run."""
    rows = []
    for name in SCHEDULES:
        v = schedule_chunks(name, chunks)
        try:
            schedule = build_schedule(name, stages, microbatches, v)
        except ScheduleError as err:
            rows.append(Comparison(name, skipped=str(err)))
            continue
        validate(schedule)
        rows.append(
            Comparison(
                name,
                schedule,
                simulate(schedule, stage_costs(name, v, costs)),
                closed_form_bubble(name, stages, microbatches, v, stage_costs(name, v, costs)),
            )
        )
    return rows


def format_table(rows: list[Comparison], unit: str = "ms") -> str:
    """The comparison as an aligned text table; `*` marks a closed form whose assumptions these costs break."""
    head = f"{'schedule':<12} {'step ' + unit:>10} {'bubble sim':>10} {'closed form':>12}  {'formula':<16} {'stash first/last/max':>20}"
    lines = [head, "-" * len(head)]
    starred = []
    for row in rows:
        if row.result is None:
            lines.append(f"{row.name:<12} skipped: {row.skipped}")
            continue
        cf, res = row.closed_form, row.result
        mark = "" if cf.exact else "*"
        starred += [] if cf.exact else [f"  * {row.name}: {cf.formula} assumes {cf.assumption}"]
        stash = f"{res.peak_stash[0]}/{res.peak_stash[-1]}/{max(res.peak_stash)}"
        lines.append(
            f"{row.name:<12} {res.step_time:>10.4g} {res.bubble_fraction:>10.4f} {cf.bubble_fraction:>11.4f}{mark:1}  {cf.formula:<16} {stash:>20}"
        )
    notes = [
        "bubble = idle / (p x step time) over all ranks; stash = activations held at once (per model chunk for interleaved, zbv, dualpipev;"
        " until W for zb-h1; from R to B for a recomputed micro-batch of 1f1b-scp)"
    ]
    return "\n".join(lines + starred + notes)


def schedule_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="behemoth schedule",
        description="Compare pipeline schedules for one configuration: "
        "step time, bubble fraction (simulated and closed form) and stashed activations.",
    )
    parser.add_argument("--stages", type=int, required=True, metavar="P", help="pipeline ranks (Chimera: D, even)")
    parser.add_argument("--microbatches", type=int, required=True, metavar="M", help="micro-batches per optimizer step")
    parser.add_argument("--chunks", type=int, default=2, metavar="V", help="model chunks per rank for interleaved (default 2)")
    parser.add_argument("--forward-ms", type=float, default=1.0, metavar="F", help="forward of one rank's share, one micro-batch")
    parser.add_argument("--backward-ms", type=float, default=1.0, metavar="B", help="input-gradient pass (full backward = B + W)")
    parser.add_argument("--weight-ms", type=float, default=1.0, metavar="W", help="weight-gradient pass")
    parser.add_argument("--p2p-ms", type=float, default=0.0, metavar="X", help="latency of one point-to-point transfer")
    parser.add_argument("--grad-sync-ms", type=float, default=0.0, metavar="S", help="Chimera's per-stage gradient all-reduce")
    parser.add_argument(
        "--grid", choices=list(SCHEDULES), metavar="NAME", help=f"print this schedule's rank x time grid in unit slots ({', '.join(SCHEDULES)})"
    )
    parser.add_argument("--gantt", metavar="FILE.png", help="write a Gantt chart: the --grid schedule, or all of them")
    return parser


def _check_costs(args: argparse.Namespace) -> Costs:
    for flag in ("forward_ms", "backward_ms", "weight_ms", "p2p_ms", "grad_sync_ms"):
        if getattr(args, flag) < 0:
            raise BehemothError(f"--{flag.replace('_', '-')} {getattr(args, flag)} is negative", "pass a time of 0 or more")
    return Costs(args.forward_ms, args.backward_ms, args.weight_ms, args.p2p_ms, args.grad_sync_ms)


def run_schedule_report(args: argparse.Namespace) -> int:
    """Print the table, then the grid and the Gantt chart if asked."""
    costs = _check_costs(args)
    check_request("gpipe", args.stages, args.microbatches)  # what every schedule needs: p >= 1, m >= 1
    rows = compare(args.stages, args.microbatches, args.chunks, costs)
    print(
        f"pipeline schedules for p={args.stages}, m={args.microbatches}, v={args.chunks} for interleaved; "
        f"F={costs.forward:g} B={costs.backward:g} W={costs.weight:g} p2p={costs.p2p:g} ms"
    )
    print(format_table(rows))
    chosen = [r for r in rows if r.result is not None and args.grid in (None, r.name)]
    if args.grid is not None:
        if not chosen:
            raise BehemothError(f"--grid {args.grid} cannot run this configuration: {rows[list(SCHEDULES).index(args.grid)].skipped}")
        print()
        print(format_grid(chosen[0].schedule))
    if args.gantt:
        path = draw_gantt([(r.schedule, r.result) for r in chosen], args.gantt)
        print(f"behemoth: wrote {path}")
    return 0


def schedule_main(argv: list[str] | None = None) -> int:
    """Entry point of `behemoth schedule`; returns the exit code (2 for a refused request)."""
    return exit_code(run_schedule_report, schedule_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(schedule_main())
