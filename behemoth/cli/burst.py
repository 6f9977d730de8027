"""`behemoth plan --burst`: DeepPool's burst plan of a model on a cluster — a data-parallel degree per layer from the
planner's costs, under a cap on device-time amplification — against plain data parallelism, and the device time it
leaves to a multiplexed background job."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING

from behemoth.errors import exit_code

if TYPE_CHECKING:  # the planner is imported when the command runs (a fast --help)
    from behemoth.config import Config
    from behemoth.planner.burst import BurstPlan, BurstProblem


def burst_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="behemoth plan --burst",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Give each layer (embedding, every block, head) only as many data-parallel devices as it uses well: a dynamic "
            "program over the layers from the planner's per-layer costs, each layer's device-time amplification capped."
        ),
        epilog="\n".join(
            [
                "examples:",
                "  behemoth plan --burst --cluster a100-80gb --world 64 model=gpt2-124m train.global_batch=64 train.seq_len=1024",
                "  behemoth plan --burst --amplification 1.5 --nproc 4 model=gpt-1m train.global_batch=8 --out burst.yaml",
                "  behemoth plan --burst --amplification inf ...     # no cap: the fastest per-layer widths",
            ]
        ),
    )
    p.add_argument("--config", metavar="FILE", help="YAML config; key=value options override it")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--cluster", metavar="FILE|PRESET", help="cluster file or preset name")
    where.add_argument("--nproc", type=int, metavar="N", help="plan for N local processes (this machine, as calibrated)")
    p.add_argument("--world", type=int, metavar="N", help="devices to plan for on --cluster (default: the cluster's own)")
    p.add_argument("--amplification", type=float, default=2.0, metavar="A", help="cap on a layer's device-time amplification (default 2; inf: none)")
    p.add_argument("--uniform", action="store_true", help="one width for every layer (the best data-parallel degree under the cap)")
    p.add_argument("--background-share", type=float, default=0.5, metavar="S", help="share of its solo rate a background job keeps (default 0.5)")
    p.add_argument("--out", metavar="FILE", help="write the config with the plan as parallel.burst (behemoth train --config FILE runs it)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config options, as for behemoth train")
    return p


BACKGROUND_BATCH = 8  # sequences per device of the background job the cluster throughput assumes


def burst_main(argv: list[str] | None = None) -> int:
    """Entry point of `behemoth plan --burst` (exit code 2 for a refused request)."""
    return exit_code(run_burst, burst_parser().parse_args(argv))


def run_burst(args: argparse.Namespace) -> int:
    from behemoth.config import load_config
    from behemoth.planner.burst import BurstProblem, ClusterPoint, background_rate
    from behemoth.planner.layout import Workload

    cfg = load_config(args.config, args.overrides)
    from behemoth.cli import cluster_and_world

    cluster, world = cluster_and_world(args)
    work = Workload.of(cfg)
    problem = BurstProblem(work, cluster, world)
    plan = problem.solve(args.amplification, uniform=args.uniform)
    dp_plan = problem.plan_of((world,) * problem.layers)  # priced exactly as plain_data_parallel (tests/test_burst_planner.py)
    dp = dp_plan.step_seconds
    s = work.census.shape
    cap = "none" if math.isinf(args.amplification) else f"{args.amplification:g}x"
    print(
        f"behemoth plan --burst: {s.n_layer} layers x d_model {s.d_model}, batch {work.global_batch} x {work.seq_len} "
        f"({work.global_batch / world:g} per device), {world} devices of {cluster.name}; amplification cap {cap}"
    )
    print(layer_table(problem, plan))
    rate = background_rate(work, cluster, BACKGROUND_BATCH)
    point = ClusterPoint(world, work.global_batch, dp_plan, plan, rate, args.background_share)
    parts = "  ".join(f"{k} {v * 1e3:.2f}" for k, v in plan.parts.items())
    print(f"burst plan           {plan.step_seconds * 1e3:9.2f} ms per step ({parts} ms), {plan.idle_fraction:.0%} of device time idle")
    print(f"data parallelism     {dp * 1e3:9.2f} ms per step on all {world} devices; burst foreground {point.foreground_ratio:.2f}x its throughput")
    print(
        f"cluster throughput   {point.cluster_throughput:.2f}x data parallelism with a background job of the same model in the idle "
        f"device time at {args.background_share:.0%} of its solo rate (data parallelism with one in its own idle time: "
        f"{point.dp_multiplexed:.2f}x)"
    )
    if args.out:
        Path(args.out).write_text(burst_config_yaml(cfg, plan))
        print(f"wrote {args.out}: behemoth train --nproc {world} --config {args.out}")
    return 0


def burst_config_yaml(cfg: Config, plan: BurstPlan) -> str:
    """The config with the plan's widths as `parallel.burst`, in the YAML a user writes (defaults left out), headed by
    the plan (`burst:` as `BurstPlan.to_yaml` writes it, commented) and its prediction."""
    import yaml

    parallel = cfg.parallel.model_copy(update={"burst": list(plan.widths)})
    data = cfg.model_copy(update={"parallel": parallel}).model_dump(mode="json", exclude_defaults=True)
    note = "".join(f"# {line}\n" for line in plan.to_yaml().splitlines())
    head = f"# behemoth plan --burst: {plan.step_seconds * 1e3:.2f} ms per step predicted on {plan.world} devices\n"
    return head + note + str(yaml.safe_dump(data, sort_keys=False, default_flow_style=None))


def layer_table(problem: BurstProblem, plan: BurstPlan) -> str:
    """One row per run of layers of one width: the layers, the width, their seconds and amplification there."""
    rows = [f"  {'layers':<24} {'devices':>7} {'compute ms':>11} {'sync ms':>8} {'amplification':>13}"]
    names = plan.names
    for a, b, c in plan.runs():
        compute, sync = problem.run_seconds(a, b, c)
        amp = max(problem.amplification(i, c) for i in range(a, b))
        label = names[a] if b - a == 1 else f"{names[a]} .. {names[b - 1]}"
        rows.append(f"  {label:<24} {c:>7} {compute * 1e3:>11.3f} {sync * 1e3:>8.3f} {amp:>12.2f}x")
    return "\n".join(rows)
