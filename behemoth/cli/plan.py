"""`behemoth plan`: the best parallel plans for a model on a cluster, ranked, explained, and written as YAML;
`behemoth calibrate`: measure this machine; and `parallel=auto` for `behemoth train`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from behemoth.errors import BehemothError, exit_code

if TYPE_CHECKING:  # the planner is imported by the commands that use it
    from behemoth.config import Config
    from behemoth.planner.cluster import ClusterSpec
    from behemoth.planner.cost import PlanCost
    from behemoth.planner.layout import Workload
    from behemoth.planner.search import Space

AUTO = "parallel=auto"


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="behemoth plan",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Search every parallel layout of a model on a cluster (dp, ep for MoE models, cp with ring or Ulysses attention for "
            "dense models without a pipeline, tp, pp, ZeRO stage, sequence parallelism, micro-batch size and count, schedule "
            "(V-shaped zbv and dualpipev and 1f1b-scp among them), per-stage recomputation, stage boundaries; offload to host memory or disk only "
            "when nothing fits), price each with the cost model (memory per rank, kept 5% below the device's usable memory; step "
            "time), and print the best ones with what binds them, why the first beats the second and the assumptions behind them."
        ),
        epilog="\n".join(
            [
                "options pinned on the command line (parallel.tp=2, parallel.schedule=zb-h1, train.micro_batch=4, ...) are not",
                "searched; everything else is. examples:",
                "  behemoth plan --nproc 4 model=gpt-20m train.global_batch=32",
                "  behemoth plan --cluster a100-80gb --world 1024 model.n_layer=96 model.d_model=12288 model.n_head=96 \\",
                "      model.vocab_size=51200 model.context=2048 train.seq_len=2048 train.global_batch=1536 train.precision=bf16",
                "  behemoth plan --cluster my-cluster.yaml model=hf:llama hf.weights=./llama --out plan.yaml",
                "  behemoth train --config plan.yaml                   # run it",
                f"  behemoth train --nproc 4 {AUTO} model=gpt-20m     # plan for 4 processes and run the best plan",
                "cluster presets: a100-80gb, h100-sxm (one 8-GPU server each; --world N spans N GPUs of them)",
            ]
        ),
    )
    p.add_argument("--config", metavar="FILE", help="YAML config; key=value options override it")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--cluster", metavar="FILE|PRESET", help="cluster file (behemoth calibrate writes one) or a preset name")
    where.add_argument("--nproc", type=int, metavar="N", help="plan for N local processes (this machine, as calibrated)")
    p.add_argument("--world", type=int, metavar="N", help="devices to plan for on --cluster (default: the cluster's own)")
    p.add_argument("--top", type=int, default=8, metavar="K", help="plans to show (default 8)")
    p.add_argument("--out", metavar="FILE", help="write the best plan as a config YAML (behemoth train --config FILE runs it)")
    p.add_argument("--burst", action="store_true", help="burst parallelism: a data-parallel degree per layer (behemoth plan --burst --help)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config options, as for behemoth train")
    return p


def plan_main(argv: list[str] | None = None) -> int:
    """Entry point of `behemoth plan`; the exit code (2 for a refused request, 3 when no plan fits)."""
    args = sys.argv[1:] if argv is None else argv
    if "--burst" in args:  # DeepPool's per-layer plan: behemoth/cli/burst.py
        from behemoth.cli.burst import burst_main

        return burst_main([a for a in args if a != "--burst"])
    return exit_code(run_plan, plan_parser().parse_args(argv))


def space_of(cfg: Config) -> Space:
    """The search space a config leaves open: every parallel option it sets explicitly is pinned."""
    from behemoth.planner.layout import Offload
    from behemoth.planner.search import Space

    plan, train, given = cfg.parallel, cfg.train, cfg.parallel.model_fields_set
    pins: dict[str, Any] = {}
    for key, field in (("tp", "tp"), ("pp", "pp"), ("dp", "dp")):
        if key in given and getattr(plan, key) is not None:
            pins[field] = (getattr(plan, key),)
    if "zero_stage" in given:
        pins["zero"] = (plan.zero_stage,)
    if "sequence_parallel" in given:
        pins["sp"] = (plan.sequence_parallel,)
    if "schedule" in given:
        pins["schedules"] = (plan.schedule,)
    if "chunks" in given:
        pins["chunks"] = (plan.chunks,)
    if "recompute" in given and plan.recompute == "none":
        pins["recompute"] = False
    if train.micro_batch is not None:
        pins["micro_batch"] = (train.micro_batch,)
    if "ep" in given:
        pins["ep"] = (plan.ep,)
    if "cp" in given:
        pins["cp"] = (plan.cp,)
    elif cfg.model.dropout:  # the sharded attention has no dropout (context_problems): not searched
        pins["cp"] = (1,)
    if "cp_mode" in given and plan.cp_mode != "auto":
        pins["cp_modes"] = (plan.cp_mode,)
    if cfg.offload.model_fields_set & {"params", "grads", "optimizer", "optimizer_bits"}:  # placed by the user: not searched
        pins["offload"] = (Offload.of(cfg),)
    return Space(**pins)


def header(cfg: Config, work: Workload, cluster: ClusterSpec, world: int) -> str:
    """The model as resolved (its shape, not only its preset name), the batch, the cluster."""
    s, name = work.census.shape, (f"hf:{cfg.hf.arch}" if cfg.hf.arch else "gpt")
    return (
        f"behemoth plan: {name} {s.n_layer} layers x d_model {s.d_model}, {s.n_head} heads ({s.kv_heads} KV), MLP {s.ffn}, "
        f"vocabulary {s.vocab_size}{', tied' if s.tied else ''}: {work.census.psi / 1e9:.3f}B parameters\n"
        f"  batch {work.global_batch} x {work.seq_len} tokens, {work.precision}"
        f"{', bf16 compute parameters' if work.param_dtype == 'bf16' else ''}; {world} devices of {cluster.name} "
        f"({cluster.device.name}, {cluster.device.memory_gb:.1f} GB, {cluster.devices_per_node} per node; {cluster.kind})"
    )


def run_plan(args: argparse.Namespace) -> int:
    from behemoth.config import load_config
    from behemoth.planner.explain import table, unfit_advice, why
    from behemoth.planner.layout import Workload
    from behemoth.planner.search import search

    t0 = time.perf_counter()
    cfg = load_config(args.config, [o for o in args.overrides if o != AUTO])
    from behemoth.cli import cluster_and_world

    cluster, world = cluster_and_world(args)
    work = Workload.of(cfg)
    result = search(work, cluster, world, space_of(cfg), cfg=cfg, top=args.top)
    print(header(cfg, work, cluster, world))
    if not result.ranked:
        space = space_of(cfg)
        print(unfit_advice(result.unfit, cluster, world, lambda w: devices_that_fit(work, cluster, w, space), offload_searched=space.offload is None))
        return 3
    print(table(result.ranked, cluster))
    print(why(result.ranked[0], result.ranked[1] if len(result.ranked) > 1 else None, cluster))
    print(assumptions(result.ranked, work, cluster))
    print(
        f"planned in {time.perf_counter() - t0:.2f} s: {result.layouts} layouts, {result.priced} priced, "
        f"{len(result.refused)} refused by problems(); "
        + (
            "every pipelined row's step time from the schedule simulator"
            if any(c.time.simulated for c in result.ranked)
            else "every row's step time from one closed form"
        )
    )
    if args.out:
        Path(args.out).write_text(plan_yaml(cfg, result.ranked[0]))
        print(f"wrote {args.out}: behemoth train --config {args.out}")
    return 0


def assumptions(ranked: list[PlanCost], work: Workload, cluster: ClusterSpec) -> str:
    """What the predictions above rest on, in numbers: the figures' source, the memory limit and its margin, the compute
    and link rates, and (where a ranked plan uses them) the pipeline's pricing, the experts' routing and offload's I/O."""
    from behemoth.planner.search import MEMORY_MARGIN

    dev, intra, inter, host = cluster.device, cluster.intra_node, cluster.inter_node, cluster.host
    dtype = work.compute_dtype
    curve = "measured matrix rates" if dev.matmul_tflops.get(dtype) else f"peak {dev.peak(dtype) / 1e12:.3g} TFLOP/s x efficiency by matrix size"
    if not dev.matmul_tflops.get(dtype):
        gemm = dev.gemm_curve(dtype)
        curve += f" (ceiling {gemm.ceiling:.3g}, half {gemm.half:.3g}: {gemm.source or 'no source stated'})"
    if dev.sustained_clock < 1.0:
        curve += f", x {dev.sustained_clock:.3g} sustained clock ({dev.sustained_source or 'no source stated'})"
    lines = [
        "Assumptions behind these predictions:",
        f"  figures: {cluster.kind} cluster {cluster.name}" + (f" ({cluster.source.splitlines()[0][:100]})" if cluster.source else ""),
        f"  memory: {(dev.memory_gb - dev.reserved_gb):.1f} GB usable per device ({dev.memory_gb:.1f} less {dev.reserved_gb:.1f} reserved); "
        f"a plan keeps {MEMORY_MARGIN:.0%} of it free (the memory model's accuracy), so none above {ranked[0].limit / 2**30:.2f} GiB is chosen",
        f"  compute ({dtype}): {curve}; a block reaches {dev.block_efficiency:.0%} of that rate; {dev.op_overhead_us:.1f} us per operator"
        + (" (issued while queued kernels run: a pass costs the larger)" if dev.async_launch else "")
        + "; "
        f"memory-bound work at {dev.memory_bandwidth_gbs:.0f} GB/s",
        f"  links: within a node {intra.latency_us:.1f} us + bytes / {intra.bandwidth_gbs:.0f} GB/s"
        + (f", between nodes {inter.latency_us:.1f} us + bytes / {inter.bandwidth_gbs:.0f} GB/s" if inter else "")
        + f"; {dev.comm_overlap:.0%} of data-parallel traffic hides behind backward, computation running "
        + f"{dev.overlap_slowdown:.0%} slower while it does ({overlap_source(cluster)})",
    ]
    if cluster.core_sharing > 1.0:
        lines.append(
            f"  shared cores: {cluster.devices_per_node} processes on {host.cores} cores per node, each measured computing beside the "
            f"others (a rank idle in a pipeline's bubble lends its share); a point-to-point message costs {host.wake_us:.0f} us more "
            "while the others compute (the woken rank waits for a core" + (", measured by behemoth calibrate)" if host.wake_us else ": not measured)")
        )
    lays = [c.layout for c in ranked]
    if host.message_cpu_us:
        lines.append(
            f"  messages: each a pipeline stage, a collective or a context-parallel ring sends or receives costs the rank "
            f"{host.message_cpu_us:.0f} us of CPU in line with its passes (measured by behemoth calibrate between computations)"
        )
    smaller = sorted(n for n in intra.group_ops if n < max(intra.group_ops, default=0))
    if smaller:
        latency = {n: intra.group_ops[n].get("all_reduce", (0.0, 0.0))[0] for n in smaller}
        lines.append(
            "  collectives of groups of " + ", ".join(map(str, smaller)) + " priced by their own measurement, all such groups at once "
            "(all-reduce "
            + ", ".join(f"{v:.0f} us" for v in latency.values())
            + f" against the whole world's {intra.ops.get('all_reduce', (0.0, 0.0))[0]:.0f})"
        )
    lines += grid_assumptions(lays)
    pipelined = sum(1 for lay in lays if lay.pp > 1)
    if pipelined:
        simulated = sum(1 for c in ranked if c.time.simulated)
        how = (
            "by the schedule simulator"
            if simulated == pipelined
            else "by the simulator's closed form (a pipeline too long to simulate quickly)"
            if not simulated
            else f"{simulated} by the schedule simulator, the rest by its closed form"
        )
        lines.append(f"  pipelines: the {pipelined} pipelined rows' step times {how} (a row without a pipeline has no bubble to simulate)")
    if any(lay.ep > 1 for lay in lays):
        routing = f"capacity factor {work.capacity_factor} (padded slots)" if work.capacity_factor is not None else "dropless, balanced routing"
        lines.append(f"  experts: {work.routed_rows:g} rows per token each way in each all-to-all ({routing}), not overlapped with compute")
    if any(lay.offload.enabled for lay in lays):
        lines.append(
            f"  offload (searched because no plan fits the devices): host memory {host.memory_bandwidth_gbs:.0f} GB/s and disk "
            f"{host.disk_bandwidth_gbs:.1f} GB/s per node, shared by its {cluster.devices_per_node} devices; host memory "
            f"{host.memory_gb:.0f} GB per node less the margin; the streamer's read-ahead hides I/O behind the passes where it can"
        )
    if any(lay.pp > 1 and lay.offload.streams for lay in lays):
        lines.append(
            "  streamed pipeline stages: each block recomputed in its stage's backward (a split backward's BI and again its W, which "
            "reads the units once more), two hidden states per block kept from a BI to its W; data-parallel traffic priced as stage 0's"
        )
    return "\n".join(lines)


def overlap_source(cluster: ClusterSpec) -> str:
    """Where the overlap slowdown comes from: measured by `behemoth calibrate`, or the preset's published figure."""
    if cluster.kind == "calibrated":
        return "measured by behemoth calibrate: a matrix loop alone and beside all-reduces"
    return "the preset's figure" + (", Lee et al. 2025's mean" if cluster.device.overlap_slowdown == 0.19 else "")


def grid_assumptions(lays: list[Any]) -> list[str]:
    """What the ranked 2-D / 2.5-D / 3-D plans' prices rest on (only when one is ranked)."""
    out = []
    modes = {lay.tp_mode for lay in lays if lay.gridded}
    if modes & {"2d", "2.5d"}:
        out.append(
            "  grids (2-D, 2.5-D): each linear 3q SUMMA steps (one latency each, a 1/q^2 weight block and a 1/(q^2 d) activation "
            "block), 2.5-D's gradients all-reduced over its d grids once per step; LayerNorm's row sums and the tables' gathers not priced"
        )
    if "3d" in modes:
        out.append(
            "  cubes (3-D): each linear six all-gathers / reduce-scatters over lines of q ranks, its gathered input and weight "
            "saved for backward (tp_regather off); LayerNorm's sums and the vectors' gathers not priced"
        )
    return out


def devices_that_fit(work: Workload, cluster: ClusterSpec, world: int, space: Space) -> int | None:
    """The smallest multiple of `world` (up to 64x) on which some plan fits."""
    from behemoth.planner.search import search

    for factor in (2, 4, 8, 16, 32, 64):
        if search(work, cluster, world * factor, space, top=1, exact=0).ranked:
            return world * factor
    return None


def plan_overrides(cost: PlanCost, cfg: Config) -> list[str]:
    """The best plan as `parallel.*` (and, offloaded, `offload.*`) options: what a user would type."""
    plan = cost.layout.but(boundaries=cost.bounds).to_plan(cfg.parallel)
    keys = (
        "dp",
        "ep",
        "cp",
        "cp_mode",
        "tp",
        "tp_mode",
        "tp_depth",
        "pp",
        "zero_stage",
        "sequence_parallel",
        "microbatches",
        "schedule",
        "chunks",
        "recompute",
        "stage_boundaries",
    )
    defaults = {"tp_mode": "1d", "tp_depth": 1}  # written only when a grid or cube is planned
    out = [
        f"parallel.{k}={flow(getattr(plan, k))}"
        for k in keys
        if getattr(plan, k) is not None and (k != "cp_mode" or plan.cp > 1) and getattr(plan, k) != defaults.get(k, object())
    ]
    off = cost.layout.offload
    if off.enabled:
        out += [f"offload.{k}={flow(v)}" for k, v in off.to_config(cfg.offload).items() if k in ("params", "grads", "optimizer", "optimizer_bits")]
    return out


def flow(value: Any) -> str:
    """A value as one YAML word (what `key=value` on the command line parses back)."""
    return str(yaml.safe_dump(value, default_flow_style=True)).strip().removesuffix("...").strip()


def plan_yaml(cfg: Config, cost: PlanCost) -> str:
    """The config with the best plan as its `parallel:` (and `offload:`) sections, in the YAML a user writes (defaults
    left out), headed by the prediction and the assumptions it rests on."""
    from behemoth.planner.search import config_of

    full = config_of(cfg, cost.layout.but(boundaries=cost.bounds))
    data = full.model_dump(mode="json", exclude_defaults=True)
    lay = cost.layout
    note = (
        f"# behemoth plan: {lay.describe()}; predicted {cost.peak_memory / 2**30:.2f} GiB per rank, "
        f"{cost.step_seconds * 1e3:.1f} ms per step, MFU {cost.mfu:.1%}\n"
    )
    text: str = yaml.safe_dump(data, sort_keys=False)
    return note + text


def auto_overrides(overrides: list[str], config: str | None, nproc: int) -> list[str]:
    """`behemoth train ... parallel=auto`: plan for `nproc` processes, print the plan, and return the overrides that
    run it (the user's own, with the plan's `parallel.*` options after them)."""
    from behemoth.config import load_config
    from behemoth.planner.calibrate import local_cluster
    from behemoth.planner.explain import table
    from behemoth.planner.layout import Workload
    from behemoth.planner.search import search

    given = [o for o in overrides if o != AUTO]
    cfg = load_config(config, given)
    cluster = local_cluster(nproc).with_nodes(nproc)
    result = search(Workload.of(cfg), cluster, nproc, space_of(cfg), cfg=cfg, top=3)
    if not result.ranked:
        light = result.unfit[0] if result.unfit else None
        need = f": the lightest plan needs {light.peak_memory / 2**30:.2f} GiB per process, {light.limit / 2**30:.2f} GiB usable" if light else ""
        raise BehemothError(
            f"{AUTO} found no plan that fits {nproc} process(es){need}",
            "run behemoth plan for the details, use more processes, or a smaller model or batch",
        )
    print(f"behemoth: {AUTO} planned for {nproc} process(es) on {cluster.name} in {result.seconds:.2f} s; running the first plan:")
    print(table(result.ranked, cluster))
    return given + plan_overrides(result.ranked[0], cfg)


def calibrate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="behemoth calibrate",
        description=(
            "Measure this machine over N local processes — matrix-multiply rate by size and dtype; all-reduce, all-gather, "
            "reduce-scatter, all-to-all and p2p latency and bandwidth; memory and disk bandwidth — and write a cluster file "
            "for behemoth plan (kept in the cache for --nproc N and parallel=auto)."
        ),
    )
    p.add_argument("--nproc", type=int, metavar="N", help="processes (default: every GPU, or 2 on a CPU-only machine)")
    p.add_argument("--full", action="store_true", help="more sizes (a few minutes); default: a quick pass")
    p.add_argument("--out", metavar="FILE", help="also write the cluster file here")
    return p


def calibrate_main(argv: list[str] | None = None) -> int:
    return exit_code(run_calibrate, calibrate_parser().parse_args(argv))


def run_calibrate(args: argparse.Namespace) -> int:
    from behemoth.cli import default_nproc
    from behemoth.planner.calibrate import cached_spec_path, calibrate

    nproc = args.nproc or default_nproc()
    t0 = time.perf_counter()
    spec = calibrate(nproc, mode="full" if args.full else "quick")
    text = spec.to_yaml()
    cached = cached_spec_path(nproc)
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(text)
    for path in filter(None, [args.out]):
        Path(path).write_text(text)
    dev, link = spec.device, spec.intra_node
    print(
        f"behemoth calibrate: {nproc} process(es), {time.perf_counter() - t0:.0f} s: {dev.name}, matmul up to "
        f"{max(dev.peak_tflops.values()):.3g} TFLOP/s, memory {dev.memory_bandwidth_gbs:.1f} GB/s, operator {dev.op_overhead_us:.1f} us, "
        f"attention {dev.flash_efficiency:.0%} of peak, a block runs at {dev.block_efficiency:.0%} of its priced speed, "
        f"{dev.comm_overlap:.0%} of a collective hides behind compute, computation {dev.overlap_slowdown:.1%} slower while one runs beside it"
    )
    for op, (latency, bandwidth) in link.ops.items():
        print(f"  {op:<15} latency {latency:8.1f} us   bus bandwidth {bandwidth:8.2f} GB/s")
    for size, ops in sorted(link.group_ops.items()):
        if size < nproc:  # groups smaller than the world, all running at once (a job's tp or dp groups)
            each = ", ".join(f"{op} {latency:.0f} us {bandwidth:.2f} GB/s" for op, (latency, bandwidth) in ops.items())
            print(f"  groups of {size} at once: {each}")
    if dev.adamw is not None:
        print(f"  AdamW step       {dev.adamw.fixed_us:8.1f} us + {dev.adamw.ns_per_element:.2f} ns per parameter element")
    if spec.core_sharing > 1.0:
        wake = spec.host.wake_us
        print(
            f"  {nproc} processes on {spec.host.cores} cores: a message waits {wake:.0f} us more for its rank to get a core while the others compute"
        )
    if spec.host.message_cpu_us:
        print(f"  a point-to-point message costs its sender and its receiver {spec.host.message_cpu_us:.0f} us of CPU each between computations")
    print(f"  disk {spec.host.disk_bandwidth_gbs:.2f} GB/s; wrote {cached}" + (f" and {args.out}" if args.out else ""))
    return 0
