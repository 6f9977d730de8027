"""`behemoth estimate`: model-state memory per rank at every ZeRO stage, formula beside measurement,
and the largest model that fits a given memory per rank."""

from __future__ import annotations

import argparse
import os
from typing import Any

from behemoth.errors import exit_code
from behemoth.planner.memory import BYTES_PER_PARAM, STAGES, GiB, StageEstimate, estimate, formula_text, largest_fitting
from behemoth.parallel.zero import comm_volume

MiB = 2**20
MEASURE_FRACTION = 0.5  # measure a stage only if all local ranks together need less than this share of RAM


def estimate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="behemoth estimate", description=(
        "Model-state memory per rank (parameters, gradients, Adam state, ZeRO buffers) at ZeRO stages 0-3: the paper's formula, "
        "behemoth's exact padded layout, and the bytes a real build holds; then the largest model that fits a memory per rank."))
    p.add_argument("--config", metavar="FILE", help="YAML config; key=value options override it")
    p.add_argument("--nproc", type=int, metavar="N", help="processes (default: every GPU, or 2 on a CPU-only machine)")
    p.add_argument("--memory-gb", type=float, metavar="M", help="memory per rank for the fit table (default: this device's)")
    p.add_argument("--no-measure", action="store_true", help="skip building the model on N local processes")
    p.add_argument("--no-calibrate", action="store_true", help="offload: skip measuring disk, memory and compute rates (no step time)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config options, as for behemoth train")
    return p


def estimate_main(argv: list[str] | None = None) -> int:
    """Entry point of `behemoth estimate`; returns the exit code (2 for a refused request)."""
    return exit_code(run_estimate, estimate_parser().parse_args(argv))


def run_estimate(args: argparse.Namespace) -> int:
    from behemoth.config import load_config

    # every stage is reported, so the plan's own stage does not matter (bf16 compute needs one >= 1 to validate)
    stage_given = any(o.startswith("parallel.zero_stage=") for o in args.overrides)
    cfg = load_config(args.config, args.overrides + ([] if stage_given else ["parallel.zero_stage=3"]))
    nproc = args.nproc or default_nproc()
    if cfg.offload.enabled:  # offloaded states: their own section (cli/estimate_offload.py)
        from behemoth.cli.estimate_offload import run_offload_estimate

        return run_offload_estimate(cfg, nproc, calibrate=not args.no_calibrate)
    dp = cfg.parallel.dims(nproc).dp
    ests = estimate(cfg, dp)
    measured = measure(cfg, nproc, ests) if not args.no_measure else {}
    print(state_table(cfg, dp, ests, measured))
    memory = args.memory_gb * GiB if args.memory_gb else device_memory(nproc)
    print()
    print(fit_table(cfg, dp, memory))
    return 0


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def device_memory(nproc: int) -> float:
    """Bytes per rank: one GPU's memory, or this machine's RAM shared by `nproc` processes."""
    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / nproc


def measure(cfg: Any, nproc: int, ests: list[StageEstimate]) -> dict[int, dict[str, int]]:
    """Rank 0's measured bytes per stage, from real builds on `nproc` local processes (stages that fit in RAM)."""
    from behemoth.launch import launch

    room = MEASURE_FRACTION * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    stages = [e.stage for e in ests if e.total * nproc < room]
    if not stages:
        return {}
    results = launch(nproc, measure_worker, cfg.model_dump(mode="json"), stages, timeout_s=cfg.run.timeout_s)
    return {r["stage"]: {**r["bytes"], "comm_volume": comm_volume(r["comm"])} for r in results[0]}


def measure_worker(cfg_dict: dict[str, Any], stages: list[int]) -> list[dict[str, Any]]:
    """One rank: build the engine at each stage, run one step on random tokens; the bytes it holds and the traffic of the step."""
    import torch

    from behemoth.config import Config
    from behemoth.engine import build_engine
    from behemoth.topology import init_runtime

    base = Config.model_validate(cfg_dict)
    rt = init_runtime(timeout_s=base.run.timeout_s, **base.parallel.degrees())
    out = []
    try:
        for stage in stages:
            plan = {**cfg_dict["parallel"], "zero_stage": stage, "param_dtype": base.parallel.param_dtype if stage else "fp32"}
            cfg = Config.model_validate({**cfg_dict, "parallel": plan})
            engine = build_engine(cfg, rt)
            tokens = torch.randint(0, cfg.model.vocab_size, (1, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
            engine.train_step([(tokens[:, :-1], tokens[:, 1:])], lr=0.0)
            out.append({"stage": stage, "bytes": engine.model_state_bytes(), "comm": engine.model.meter.summary()})
            del engine
    finally:
        rt.close()
    return out


def state_table(cfg: Any, dp: int, ests: list[StageEstimate], measured: dict[int, dict[str, int]]) -> str:
    """Per stage: components, formula vs exact vs measured totals, buffers (MiB, rank 0)."""
    dtype = cfg.parallel.param_dtype
    p, g, k = BYTES_PER_PARAM[dtype]
    psi, pad = ests[0].psi, max(e.padding for e in ests)
    lines = [f"behemoth estimate: {cfg.model.preset}, Ψ = {psi:,} parameters, N = dp = {dp}, Adam, stages 1-3 {dtype} "
             f"(bytes per parameter: {p} param + {g} grad + {k} optimizer; stage 0 is float32)",
             f"model states per rank, MiB (rank 0; exact = behemoth's layout, padded by at most N-1 elements per group: {pad} here); "
             "traffic = elements a rank moves in one step of one micro-batch (all-reduce counted twice its size; formula: exact)",
             f"{'stage':<6}{'formula':<13}{'params':>9}{'grads':>9}{'optim':>9} | {'formula':>9}{'exact':>9}{'measured':>10} | "
             f"{'traffic per step':<18}{'measured':>14} | buffers exact / measured"]
    for e in ests:
        m = measured.get(e.stage)
        got = f"{(m['params'] + m['grads'] + m['optimizer']) / MiB:>10.2f}" if m else f"{'-':>10}"
        buffers = ", ".join(f"{name} {size / MiB:.2f} / {m[name] / MiB:.2f}" if m and name in m else f"{name} {size / MiB:.2f}"
                            for name, size in e.buffers.items()) or "-"
        traffic = f"{3 if e.stage == 3 else 2}Ψ: {e.traffic:,}"  # exact: padding, and at stage 3 the embedding gathered once
        moved = f"{m['comm_volume']:>14,}" if m else f"{'-':>14}"
        lines.append(f"{e.stage:<6}{formula_text(e.stage, dtype if e.stage else 'fp32'):<13}{e.params / MiB:>9.2f}{e.grads / MiB:>9.2f}"
                     f"{e.optimizer / MiB:>9.2f} | {sum(e.formula.values()) / MiB:>9.2f}{e.states / MiB:>9.2f}{got} | {traffic:<18}{moved} | {buffers}")
    if not measured:
        lines.append("(not measured: --no-measure, or every stage needs more than half of this machine's memory)")
    return "\n".join(lines)


def fit_table(cfg: Any, dp: int, memory: float) -> str:
    """The largest Ψ whose model states fit `memory` per rank at each stage, and the largest preset that does."""
    from behemoth.models.gpt import PRESETS, GPTConfig

    dtype = cfg.parallel.param_dtype
    limits = largest_fitting(memory, dp, dtype)
    sizes = sorted(((GPTConfig(preset=name).num_params(), name) for name in PRESETS), reverse=True)
    lines = [f"largest model whose states fit {memory / GiB:.1f} GiB per rank on N = {dp} (formula; activations not included):"]
    for stage in STAGES:
        preset = next((f"{name} ({n / 1e6:,.0f}M)" for n, name in sizes if n <= limits[stage]), "none of the presets")
        lines.append(f"  stage {stage}: Ψ <= {limits[stage] / 1e9:,.2f}B   largest preset: {preset}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(estimate_main())
