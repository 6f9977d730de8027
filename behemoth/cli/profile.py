"""`behemoth profile`: where a step's time goes for one plan, by differential runs on local processes, beside the
planner's prediction for the same plan (behemoth/profiler/, docs/profiling.md)."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from behemoth.errors import BehemothError, exit_code


def profile_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="behemoth profile",
        description=(
            "Profile one plan: the same engine stepped on synthetic data (compute + collectives), on the real corpus "
            "(+ data preparation) and with a checkpoint every step (+ storage I/O), plus one process without collectives "
            "for a data-parallel plan; seconds and percent per component beside the planner's prediction."
        ),
        epilog="examples:\n  behemoth profile --nproc 2 model=gpt-tiny\n  behemoth profile --nproc 2 parallel.tp=2 --steps 5 --trace",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", help="YAML config; key=value options override it")
    p.add_argument("--nproc", type=int, metavar="N", help="local processes (default: every GPU, or 2 on a CPU-only machine)")
    p.add_argument("--steps", type=int, default=5, metavar="N", help="measured steps per run (default 5)")
    p.add_argument("--warmup", type=int, default=1, metavar="N", help="steps before the measured ones, per run (default 1)")
    p.add_argument("--runs", default="synthetic,data,io", help="differential runs, in order (default synthetic,data,io)")
    p.add_argument("--cluster", metavar="FILE|PRESET", help="hardware the prediction uses (default: this machine, calibrated or probed)")
    p.add_argument("--no-compute-only", action="store_true", help="skip the one-process run without collectives")
    p.add_argument(
        "--json", metavar="FILE", help="also write every rank's raw timings and the calibration `behemoth recommend --calibrate FILE` reads here"
    )
    p.add_argument(
        "--node-size",
        type=int,
        metavar="N",
        help="ranks per node, for the intra- vs inter-node split of communication (default: LOCAL_WORLD_SIZE, else one node)",
    )
    p.add_argument("--trace", metavar="DIR", nargs="?", const="profile-trace", help="also record a torch.profiler trace per rank into DIR")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config options, as for behemoth train")
    return p


def profile_main(argv: list[str] | None = None) -> int:
    """Entry point of `behemoth profile`; the exit code (2 for a refused plan)."""
    return exit_code(run_profile, profile_parser().parse_args(argv))


def run_profile(args: argparse.Namespace) -> int:
    from behemoth.cli import default_nproc
    from behemoth.config import load_config
    from behemoth.faults.launch import launch
    from behemoth.faults.recovery import plan_for_world
    from behemoth.planner.feasibility import refuse
    from behemoth.profiler.report import Profile, table
    from behemoth.profiler.stall import RUNS, one_rank_config, profile_worker

    world = args.nproc or default_nproc()
    runs = tuple(r.strip() for r in args.runs.split(",") if r.strip())
    bad = [r for r in runs if r not in RUNS]
    if bad or args.steps < 1 or args.warmup < 0 or (args.node_size is not None and not 1 <= args.node_size <= world):
        raise BehemothError(
            f"--runs {args.runs} / --steps {args.steps} / --warmup {args.warmup} / --node-size {args.node_size} is not a profile",
            f"use runs from {', '.join(RUNS)}, --steps >= 1, --warmup >= 0, 1 <= --node-size <= {world}",
        )
    cfg = plan_for_world(load_config(args.config, [*args.overrides, "run.progress=false"]), world)
    refuse(cfg, world)
    scratch = None if cfg.run.dir else tempfile.mkdtemp(prefix="behemoth-profile-")
    cfg_dict = cfg.model_dump(mode="json")
    cfg_dict["run"]["dir"] = cfg.run.dir or scratch
    try:
        results = launch(world, profile_worker, cfg_dict, args.steps, args.warmup, runs, args.trace, args.node_size, timeout_s=cfg.run.timeout_s)
        one = None if args.no_compute_only or world == 1 else one_rank_config(cfg_dict, world)
        alone = launch(1, profile_worker, one, args.steps, args.warmup, ("synthetic",), timeout_s=cfg.run.timeout_s)[0] if one else None
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
    ranks = [results[r] for r in sorted(results)]
    profile = Profile(ranks, predicted(cfg, world, args.cluster), alone, plan=plan_line(cfg, world))
    print(table(profile))
    if args.json:
        result = {"ranks": ranks, "compute_only": alone, "calibration": profile.calibration(args.cluster)}
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.trace:
        print(f"traces: {args.trace}/ (one Chrome-trace JSON per rank; open in https://ui.perfetto.dev or TensorBoard)")
    return 0


def predicted(cfg: Any, world: int, cluster_name: str | None) -> Any:
    """The planner's step time of this plan, on the given cluster or this machine (simulated when pipelined)."""
    from behemoth.planner.calibrate import local_cluster
    from behemoth.planner.cluster import load_cluster
    from behemoth.planner.cost import price
    from behemoth.planner.layout import Layout, Workload

    cluster = (load_cluster(cluster_name) if cluster_name else local_cluster(world)).with_nodes(world)
    return price(Workload.of(cfg), Layout.of_config(cfg, world), cluster, exact=True).time


def plan_line(cfg: Any, world: int) -> str:
    from behemoth.planner.layout import Layout

    return f"{Layout.of_config(cfg, world).describe()} on {world} process(es), {cfg.seq_len} tokens per sequence"


if __name__ == "__main__":
    raise SystemExit(profile_main())
