"""`behemoth estimate`: the memory one plan needs per rank, on paper for any world size (the planner's memory half):
the model states of a rank's share at every ZeRO stage (the paper's formula beside behemoth's exact layout), the
plan's memory on every pipeline rank (states, ZeRO buffers, stashed activations, working set, peak), and the largest
model whose states fit a memory per rank. With --measure, real processes build the plan and the measurements stand
beside the estimates."""

from __future__ import annotations

import argparse
import os
from typing import Any

from behemoth.cli import default_nproc
from behemoth.config import Config
from behemoth.errors import BehemothError, exit_code
from behemoth.parallel.zero import comm_volume
from behemoth.planner.memory import BYTES_PER_PARAM, STAGES, GiB, StageEstimate, estimate, formula_text, largest_fitting

MEASURE_FRACTION = 0.5  # measure only if all local ranks together need less than this share of RAM


def estimate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="behemoth estimate",
        description=(
            "Memory per rank of one plan (dp, tp, pp, ZeRO stage, sequence parallelism, recompute, schedule), for any world "
            "size on paper: model states at ZeRO stages 0-3 (formula and behemoth's exact layout), each pipeline rank's "
            "states, buffers, activations and peak, in GB and GiB; then the largest model whose states fit a memory per rank. "
            "behemoth plan searches the plans; this prices the one you give."
        ),
    )
    p.add_argument("--config", metavar="FILE", help="YAML config; key=value options override it")
    p.add_argument("--world", type=int, metavar="N", help="processes the plan runs on, on paper (default: --nproc)")
    p.add_argument("--nproc", type=int, metavar="N", help="local processes (default: every GPU, or 2 on a CPU-only machine)")
    p.add_argument("--memory-gb", type=float, metavar="M", help="GiB per rank for the fit table (default: this device's)")
    p.add_argument("--measure", action="store_true", help="also build the plan on N local processes and measure it")
    p.add_argument("--no-calibrate", action="store_true", help="offload: skip measuring disk, memory and compute rates (no step time)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config options, as for behemoth train")
    return p


def estimate_main(argv: list[str] | None = None) -> int:
    """Entry point of `behemoth estimate`; returns the exit code (2 for a refused request)."""
    return exit_code(run_estimate, estimate_parser().parse_args(argv))


def run_estimate(args: argparse.Namespace) -> int:
    from behemoth.config import load_config
    from behemoth.errors import Refused
    from behemoth.planner.feasibility import problems

    # every stage is reported; the plan's own stage prices the per-rank table (bf16 parameters need one >= 1)
    stage_given = any(o.startswith("parallel.zero_stage=") for o in args.overrides)
    cfg = load_config(args.config, args.overrides + ([] if stage_given or not _bf16(args) else ["parallel.zero_stage=1"]))
    world = args.world or args.nproc or default_nproc()
    if cfg.offload.enabled:  # offloaded states: their own section (cli/estimate_offload.py)
        from behemoth.cli.estimate_offload import run_offload_estimate

        return run_offload_estimate(cfg, world, calibrate=not args.no_calibrate)
    found = [p for p in problems(cfg, world) if p.option != "parallel.memory_gb"]
    if found:
        raise Refused(found)
    dims = cfg.parallel.dims(world)
    ests = estimate(cfg, world=world)
    measured = measure(cfg, world, ests) if args.measure else {}
    print(header(cfg, world))
    print(state_table(cfg, dims.dp, ests, measured))
    print()
    print(plan_table(cfg, world, args.measure))
    memory = args.memory_gb * GiB if args.memory_gb else device_memory(world)
    print()
    print(fit_table(cfg, dims.dp, memory))
    return 0


def _bf16(args: argparse.Namespace) -> bool:
    return any(o.replace(" ", "") == "parallel.param_dtype=bf16" for o in args.overrides)


def device_memory(nproc: int) -> float:
    """Bytes per rank: one GPU's memory, or this machine's RAM shared by `nproc` processes."""
    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / nproc


def size(b: float) -> str:
    """Bytes readable at any size, binary and decimal: `1.85 GiB (1.99 GB)`."""
    if abs(b) < 1024:
        return f"{b:.0f} B"
    unit, step = next((u, s) for u, s in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if abs(b) >= s)
    dec_unit, dec = next((u, s) for u, s in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if abs(b) >= s)
    return f"{b / step:.3g} {unit} ({b / dec:.3g} {dec_unit})"


def header(cfg: Config, world: int) -> str:
    """The resolved model (its shape, whatever the preset), Ψ, and the plan's degrees."""
    from behemoth.planner.census import ModelCensus

    census = ModelCensus.of(cfg.model, cfg.hf, cfg.finetune.lora)
    s, plan = census.shape, cfg.parallel
    dims = plan.dims(world)
    name = f"hf:{cfg.hf.arch}" if cfg.hf.arch else "gpt"
    return (
        f"behemoth estimate: {name} {s.n_layer} layers x d_model {s.d_model}, {s.n_head} heads ({s.kv_heads} KV), MLP {s.ffn}, "
        f"vocabulary {s.vocab_size}{', tied' if s.tied else ''}; Ψ = {census.psi:,} parameters\n"
        f"  plan on {world} processes: dp={dims.dp} x tp={dims.tp} x pp={dims.pp}, ZeRO-{plan.zero_stage}"
        f"{', sequence parallel' if plan.sequence_parallel and dims.tp > 1 else ''}, recompute {plan.recompute}"
        f"{f', {plan.schedule}' if dims.pp > 1 else ''}; micro-batch {cfg.batch_layout(dims).micro_batch} x {cfg.seq_len} tokens"
    )


def measure(cfg: Config, world: int, ests: list[StageEstimate]) -> dict[int, dict[str, int]]:
    """Rank 0's measured bytes per ZeRO stage, from real builds on `world` local processes (stages that fit in RAM;
    without a pipeline: a pipelined step needs the plan's micro-batches, which `plan_table` measures)."""
    from behemoth.faults.launch import launch

    room = MEASURE_FRACTION * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    stages = [e.stage for e in ests if e.total * world < room]
    if not stages or cfg.parallel.pp > 1:
        return {}
    results = launch(world, measure_worker, cfg.model_dump(mode="json"), stages, timeout_s=cfg.run.timeout_s)
    return {r["stage"]: {**r["bytes"], "comm_volume": comm_volume(r["comm"])} for r in results[0]}


def measure_worker(cfg_dict: dict[str, Any], stages: list[int]) -> list[dict[str, Any]]:
    """One rank: build the engine at each stage, run one step of one micro-batch of random tokens; the bytes it holds and
    the traffic of the step."""
    from behemoth.config import Config
    from behemoth.engine import build_engine
    from behemoth.profiler.measure import random_micro_batches
    from behemoth.topology import init_runtime

    base = Config.model_validate(cfg_dict)
    rt = init_runtime(timeout_s=base.run.timeout_s, **base.parallel.degrees())
    out = []
    try:
        for stage in stages:
            plan = {**cfg_dict["parallel"], "zero_stage": stage, "param_dtype": base.parallel.param_dtype if stage else "fp32"}
            cfg = Config.model_validate({**cfg_dict, "parallel": plan})
            engine = build_engine(cfg, rt)
            engine.model.measure_buffers()
            engine.train_step(random_micro_batches(cfg, rt.dims, seed=0)[:1], lr=0.0)  # one micro-batch of the plan's size
            out.append({"stage": stage, "bytes": engine.model_state_bytes(), "comm": engine.model.meter.summary()})
            del engine
    finally:
        rt.close()
    return out


def state_table(cfg: Config, dp: int, ests: list[StageEstimate], measured: dict[int, dict[str, int]]) -> str:
    """Per ZeRO stage: components, formula vs exact vs measured totals, buffers (pipeline rank 0's share, dp rank 0)."""
    dtype = cfg.parallel.param_dtype
    p, g, k = BYTES_PER_PARAM[dtype]
    psi, pad = ests[0].psi, max(e.padding for e in ests)
    share = "" if cfg.parallel.tp == cfg.parallel.pp == 1 else " on pipeline rank 0, one tensor-parallel rank's share"
    lines = [
        f"model states per rank{share}: Ψ = {psi:,} parameters, N = dp = {dp}, Adam, stages 1-3 {dtype} "
        f"(bytes per parameter: {p} param + {g} grad + {k} optimizer; stage 0 is float32)",
        f"exact = behemoth's layout, padded by at most N-1 elements per group ({pad} here); traffic = elements a rank moves "
        "in one step of one micro-batch (all-reduce counted twice its size)",
        f"{'stage':<6}{'formula':<13}{'params':>11}{'grads':>11}{'optim':>11} | {'formula':>11}{'exact':>11}{'measured':>11} | "
        f"{'traffic':<18}{'measured':>14} | buffers exact / measured",
    ]
    for e in ests:
        m = measured.get(e.stage)
        got = f"{_gib(m['params'] + m['grads'] + m['optimizer']):>11}" if m else f"{'-':>11}"
        buffers = (
            ", ".join(f"{name} {_gib(size_)} / {_gib(m[name])}" if m and name in m else f"{name} {_gib(size_)}" for name, size_ in e.buffers.items())
            or "-"
        )
        traffic = f"{3 if e.stage == 3 else 2}Ψ: {e.traffic:,}"
        moved = f"{m['comm_volume']:>14,}" if m else f"{'-':>14}"
        lines.append(
            f"{e.stage:<6}{formula_text(e.stage, dtype if e.stage else 'fp32'):<13}{_gib(e.params):>11}{_gib(e.grads):>11}"
            f"{_gib(e.optimizer):>11} | {_gib(sum(e.formula.values())):>11}{_gib(e.states):>11}{got} | {traffic:<18}{moved} | {buffers}"
        )
    why = "--measure builds each stage on local processes, without a pipeline" if cfg.parallel.pp == 1 else "a pipelined plan is measured below"
    lines.append("(GiB; 1 GiB = 1.074 GB)" + ("" if measured else f"; not measured ({why})"))
    if cfg.finetune.lora.enabled:
        lines.append(
            "finetune.lora: this table prices a full fine-tune of the base; the plan below holds the frozen base at 4 bytes per "
            "parameter and the adapters at the stage's bytes (ZeRO 1-2 shard only the adapters)"
        )
    return "\n".join(lines)


def _gib(b: float) -> str:
    """GiB with enough digits to read a small model and a large one alike."""
    v = b / GiB
    return f"{v:.4f}" if v < 0.1 else f"{v:.3f}" if v < 100 else f"{v:,.1f}"


def plan_table(cfg: Config, world: int, measure_it: bool) -> str:
    """The plan's memory on each pipeline rank: states, buffers, activations, working set, peak (and measured peaks)."""
    from behemoth.planner.cluster import load_cluster
    from behemoth.planner.cost import price
    from behemoth.planner.layout import Layout, Workload

    work, lay = Workload.of(cfg), Layout.of_config(cfg, world)
    cost = price(work, lay, load_cluster("a100-80gb").with_nodes(world))  # memory does not depend on the cluster
    got = measure_peaks(cfg, world) if measure_it else {}
    lines = [
        f"memory per rank under this plan ({lay.describe()}), predicted" + (" / measured" if got else "") + ":",
        f"{'pp rank':>7}  {'states':>22}  {'buffers':>22}  {'activations':>22}  {'working set':>22}  {'peak':>22}",
    ]
    for m in cost.memory:
        peak = size(m.peak) + (f" / {size(got[m.rank]['peak'])}" if m.rank in got else "")
        lines.append(f"{m.rank:>7}  {size(m.states):>22}  {size(m.buffers):>22}  {size(m.stash):>22}  {size(m.working + m.deferred):>22}  {peak:>22}")
    return "\n".join(lines)


def measure_peaks(cfg: Config, world: int) -> dict[int, dict[str, Any]]:
    """Measured memory of every pipeline rank (its busiest data- and tensor-parallel rank), from real processes."""
    from behemoth.faults.launch import launch
    from behemoth.profiler.measure import measure_plan

    room = MEASURE_FRACTION * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if world * estimate(cfg, world=world, stages=(cfg.parallel.zero_stage,))[0].total > room:
        raise BehemothError(
            f"--measure: {world} processes of this plan need more than half of this machine's memory",
            "estimate without --measure, or measure a smaller model",
        )
    results = launch(world, measure_plan, cfg.model_dump(mode="json"), 1, 1, timeout_s=cfg.run.timeout_s)
    out: dict[int, dict[str, Any]] = {}
    for r in results.values():
        pp = r["coords"]["pp"]
        if pp not in out or r["peak"] > out[pp]["peak"]:
            out[pp] = r
    return out


def fit_table(cfg: Config, dp: int, memory: float) -> str:
    """The largest Ψ whose model states fit `memory` per rank at each stage, and the largest preset that does."""
    from behemoth.models.gpt import PRESETS, GPTConfig

    dtype = cfg.parallel.param_dtype
    split = cfg.parallel.tp * cfg.parallel.pp
    limits = {s: n * split for s, n in largest_fitting(memory, dp, dtype).items()}
    sizes = sorted(((GPTConfig(preset=name).num_params(), name) for name in PRESETS), reverse=True)
    across = f" x tp={cfg.parallel.tp} x pp={cfg.parallel.pp}" if split > 1 else ""
    lines = [f"largest model whose states fit {memory / GiB:.1f} GiB per rank on N = {dp}{across} (formula; activations not included):"]
    for stage in STAGES:
        preset = next((f"{name} ({n / 1e6:,.0f}M)" for n, name in sizes if n <= limits[stage]), "none of the presets")
        lines.append(f"  stage {stage}: Ψ <= {limits[stage] / 1e9:,.2f}B   largest preset: {preset}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(estimate_main())
