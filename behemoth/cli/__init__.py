"""The `behemoth` command."""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from pydantic import BaseModel

from behemoth.errors import ERROR_PREFIX, BehemothError, Problem, exit_code

if TYPE_CHECKING:  # the config module is imported by the commands that use it (a fast --help)
    from behemoth.config import Config
    from behemoth.planner.cluster import ClusterSpec


def option_table(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """`section.key  type  default  description` for every config option."""
    from behemoth.config import Config

    model = model or Config
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += option_table(ann, key + ".")
            continue
        default = field.get_default(call_default_factory=True)
        kind = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
        rows.append(f"  {key:<26} {kind:<14} default {default!s:<10} {field.description or ''}")
    return rows


def train_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from behemoth.models.gpt import PRESETS

    epilog = "\n".join(
        [
            "options (key=value, as many as you like; `model=NAME` picks a preset):",
            *option_table(),
            "",
            f"model presets: {', '.join(PRESETS)}",
            "examples:",
            "  behemoth train                                   # gpt-1m on the Python stdlib, 2 processes on a CPU",
            "  behemoth train --nproc 4 train.steps=100 data.path=~/notes",
            "  behemoth train --resume                          # continue the newest run under runs/",
            "  behemoth train --nproc 4 parallel.zero_stage=3 model=gpt-20m          # ZeRO-3: parameters sharded over 4",
            "  behemoth train --nproc 4 parallel.tp=2 parallel.sequence_parallel=true  # tensor x data parallel, 2 x 2",
            "  behemoth train --nproc 4 parallel.pp=4 parallel.schedule=zb-h1 train.micro_batch=2  # 4-stage pipeline",
            "  behemoth train model=hf:llama hf.weights=./my-llama parallel.tp=2      # a transformers Llama from local weights",
            "  behemoth train --nproc 2 model=gpt-moe-1m parallel.ep=2               # 8 experts every 2nd block, 4 per rank",
            "  behemoth train --nproc 4 parallel=auto model=gpt-20m  # plan for 4 processes (behemoth plan), run the best plan",
            "  behemoth train --nproc 1 model=gpt2-1.5b offload.params=disk offload.optimizer=disk offload.max_memory_gb=4  # out of core",
            "    (an offloaded run's checkpoints link its scratch files, not copy them; it exports weights only with checkpoint.export=true)",
            "  behemoth train --nproc 4 --max-restarts 3 checkpoint.every=50  # self-healing: a failed worker restarts and resumes",
            "  behemoth train --nproc 2:4 --max-restarts 3     # elastic: continues on 2 or 3 processes if some are lost",
            "  torchrun --nproc-per-node 8 -m behemoth train model=gpt2-124m   # many GPUs or machines",
        ]
    )
    p = sub.add_parser(
        "train",
        help="train a model",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a GPT (or a transformers Llama / GPT-2) on N local processes with data, ZeRO, tensor and "
        "pipeline parallelism, writing metrics, a loss plot and checkpoints.",
    )
    p.add_argument("--config", metavar="FILE", help="YAML config; key=value options override it")
    p.add_argument(
        "--nproc",
        metavar="N|MIN:MAX",
        help="local worker processes (default: every GPU, or 2 on a CPU-only machine); "
        "MIN:MAX runs MAX elastic single-process nodes that continue on as few as MIN when some are lost",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const="newest",
        metavar="PATH",
        help="continue a run: a run directory, a checkpoint folder, or nothing for the newest run under runs/",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="restart failed workers up to N times, each time resuming from the newest intact checkpoint (default 0)",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config options, e.g. train.steps=100 (listed below)")


def export_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint's weights as one safetensors file",
        description="Consolidate a checkpoint (any process count) into a safetensors file.",
    )
    p.add_argument("path", help="a run directory (its latest checkpoint) or a checkpoint folder")
    p.add_argument("--out", metavar="FILE", help="output file (default: model.safetensors next to the checkpoints)")
    p.add_argument(
        "--hf",
        metavar="DIR",
        help="instead, a transformers save_pretrained folder (config.json + safetensors in the "
        "Hugging Face layout, e.g. Mixtral's per-expert weights) of a model=hf:* run",
    )
    p.add_argument("--merge", action="store_true", help="a LoRA run: its adapters merged into the base weights, an HF folder at --out DIR")


def delegated_commands() -> dict[str, tuple[str, str]]:
    """Commands whose own module parses their arguments: name -> (module:function, help)."""
    return {
        "schedule": (
            "behemoth.parallel.pipeline.analysis.report:schedule_main",
            "compare pipeline schedules: bubble, step time, memory, Gantt chart",
        ),
        "estimate": ("behemoth.cli.estimate:estimate_main", "memory per rank of one plan (any layout, any world size): states, activations, peak"),
        "plan": ("behemoth.cli.plan:plan_main", "search the parallel plans of a model on a cluster: ranked, explained, written as YAML"),
        "calibrate": ("behemoth.cli.plan:calibrate_main", "measure this machine (matmul, collectives, memory, disk, AdamW) into a cluster file"),
        "generate": ("behemoth.cli.generate:generate_main", "generate text from a checkpoint or HF folder (KV cache; tp, pp, offload, int8)"),
        "eval": ("behemoth.cli.eval:eval_main", "loss and perplexity of a run or HF folder on a corpus (its tokenizer, its chat masking)"),
        "serve": ("behemoth.cli.serve:serve_main", "serve a model: OpenAI-compatible /v1/completions with continuous batching"),
        "profile": ("behemoth.cli.profile:profile_main", "where a plan's step time goes: differential runs, components vs the planner's prediction"),
        "recommend": ("behemoth.cli.recommend:recommend_main", "which instance type and count to rent for a model and tokens: time, cost, runner-up"),
        "graph": ("behemoth.cli.graph:graph_main", "draw a plan's step as a dataflow graph (rank lanes, messages, critical path): SVG or HTML"),
        "bench": ("behemoth.cli.bench:bench_main", "every benchmark against every peer installed: one table of ratios, a chart per family"),
        "sweep": ("behemoth.cli.sweep:sweep_main", "many runs of one base config (grid/list/random, ASHA pruning, Ray): a leaderboard"),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="behemoth", description="Train and serve PyTorch models larger than one device.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train_parser(sub)
    export_parser(sub)
    for name, (_, help_text) in delegated_commands().items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def run_delegated(name: str, argv: list[str]) -> int:
    import importlib

    target, _ = delegated_commands()[name]
    module, func = target.split(":")
    entry: Callable[[list[str]], int] = getattr(importlib.import_module(module), func)
    return entry(argv)


def default_nproc() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def cluster_and_world(args: argparse.Namespace) -> tuple[ClusterSpec, int]:
    """The cluster to plan on and its device count (`behemoth plan`, `plan --burst`): a file or preset (and --world), or
    this machine's --nproc processes."""
    from behemoth.planner.calibrate import local_cluster
    from behemoth.planner.cluster import load_cluster

    if args.cluster:
        cluster = load_cluster(args.cluster)
        world = args.world or cluster.world
    else:
        world = args.nproc or default_nproc()
        cluster = local_cluster(world)
    if world < 1:
        raise BehemothError(f"--world {world} is not a device count", "use --world 1 or more")
    return cluster.with_nodes(world), world


def newest_run(root: Path = Path("runs")) -> Path:
    runs = sorted((p for p in root.glob("*") if (p / "checkpoints" / "latest").exists()), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise BehemothError(f"--resume found no run with a checkpoint under {root}/", "pass the run directory: --resume runs/NAME")
    return runs[-1]


def resolve_train_config(args: argparse.Namespace) -> tuple[Config, Path | None]:
    """The validated config and, with --resume, the checkpoint to start from."""
    from behemoth.config import default_run_dir, load_config
    from behemoth.faults.checkpoint import resolve_checkpoint
    from behemoth.faults.launch import launched_by_torchrun

    if args.resume is None:
        cfg = load_config(args.config, args.overrides)  # under torchrun the workers agree on a run directory themselves
        return (cfg if cfg.run.dir or launched_by_torchrun() else cfg.replace(run={"dir": default_run_dir()})), None
    ckpt = resolve_checkpoint(newest_run() if args.resume == "newest" else Path(args.resume))
    run_dir = ckpt.parent.parent
    base = args.config or (run_dir / "config.yaml" if (run_dir / "config.yaml").exists() else None)
    cfg = load_config(base, [f"run.dir={run_dir}", *args.overrides])
    return cfg, ckpt


def worker(cfg_dict: dict[str, Any], ckpt: str | None, launch_id: str | None = None) -> dict[str, Any]:
    """Entry point of one launched worker process (the same arguments at every restart of the launch)."""
    from behemoth.config import Config
    from behemoth.train import train

    try:
        return train(Config.model_validate(cfg_dict), resume=Path(ckpt) if ckpt else None, verified=True, launch_id=launch_id)
    except BaseException as err:
        fail_fast(err)


def fail_fast(err: BaseException, code: int = 1) -> NoReturn:
    """A failed worker prints its line(s), leaves them for the launcher (the elastic error file) and exits at once:
    tearing down process groups whose peer is stopped can keep a process alive for half a minute."""
    import traceback

    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    from behemoth.flight import HangError

    lines = err.lines if isinstance(err, BehemothError) else [text for text in traceback.format_exception(err) if text.strip()]
    prefix = ERROR_PREFIX if isinstance(err, BehemothError) else ""
    if isinstance(err, HangError) and not err.timed_out:
        time.sleep(1.0)  # a peer went away first: let the launcher see its failure (the cause) before this one
    try:
        for line in lines:
            print(f"{prefix}{line.rstrip()}", file=sys.stderr, flush=True)
        ErrorHandler().record_exception(err)
    finally:
        os._exit(code)


def parse_nproc(text: str | None) -> int | tuple[int, int]:
    """`--nproc N` or `--nproc MIN:MAX` (default: every GPU, or 2 on a CPU-only machine)."""
    if text is None:
        return default_nproc()
    try:
        if ":" in text:
            low, high = (int(part) for part in text.split(":"))
            if not 1 <= low <= high:
                raise ValueError
            return (low, high) if low < high else low
        return int(text)
    except ValueError:
        raise BehemothError(f"--nproc {text} is not a process count or a range", "write --nproc N, or --nproc MIN:MAX with 1 <= MIN <= MAX") from None


def elastic_problems(cfg: Config, nproc: tuple[int, int], max_restarts: int) -> list[Problem]:
    """An elastic range the plan cannot run on at every size, or one that cannot continue because nothing restarts."""
    from behemoth.faults.recovery import plan_for_world
    from behemoth.planner.feasibility import problems

    low, high = nproc
    out: list[Problem] = []
    if max_restarts < 1:
        out.append(
            Problem.of(
                "--max-restarts",
                f"--nproc {low}:{high} continues on fewer processes by restarting the survivors, but --max-restarts is 0",
                "add --max-restarts 3 (or any number above 0)",
            )
        )
    for world in range(low, high):  # the largest size is checked with the launch's other problems
        found = problems(plan_for_world(cfg, world), world)
        if found and cfg.elastic.replan:  # a restart on this size will run the planner's plan for it
            from behemoth.planner.replan import replan

            try:
                found = problems(replan(cfg, world), world)
            except BehemothError as err:
                found = [Problem.from_error("elastic.replan", err)]
        if found:
            out.append(
                Problem.of(
                    "--nproc",
                    f"--nproc {low}:{high}: the plan cannot run on {world} processes ({found[0].message})",
                    "choose a range whose every process count can run it",
                )
            )
    return out


def launch_line(cfg: Config, nproc: int | tuple[int, int]) -> str:
    """What is about to run: the model, its size, the plan, the batch, the steps, where it goes; and any field of a
    Hugging Face config.json an option overrides."""
    from behemoth.models.causal_lm import num_params
    from behemoth.models.hf import config_overrides
    from behemoth.planner.feasibility import describe_plan

    name = f"hf:{cfg.hf.arch}" if cfg.hf.arch else cfg.model.preset
    params = num_params(cfg.model, cfg.hf)
    most = nproc[1] if isinstance(nproc, tuple) else nproc
    count = f"{nproc[0]}-{most} elastic" if isinstance(nproc, tuple) else str(most)
    line = (
        f"behemoth: {name} ({params / 1e6:.2f}M parameters), {count} process(es) {describe_plan(cfg, most)}, "
        f"batch {cfg.train.global_batch}x{cfg.seq_len} tokens, {cfg.train.steps} steps -> {cfg.run.dir}"
    )
    if cfg.offload.enabled:
        off = cfg.offload
        line += (
            f"\nbehemoth: offload: params {off.params}{' (float32 masters, bf16 compute)' if cfg.parallel.param_dtype == 'bf16' else ''}, "
            f"grads {off.grads_tier}, optimizer {off.optimizer} ({off.optimizer_bits}-bit), "
            f"{off.order + ' order' if cfg.parallel.pp == 1 else 'each stage in its schedule order'}, prefetch {off.prefetch}"
            + (f", budget {off.max_memory_gb} GiB" if off.max_memory_gb else "")
            + (", steps committed through a journal" if off.commit == "journal" else "")
        )
    changed = config_overrides(cfg.model, cfg.hf) if cfg.hf.arch else {}
    if changed:
        fields = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
        line += f"\nbehemoth: hf.weights={cfg.hf.weights}: config.json overridden by the model section: {fields}"
    return line


def run_train(args: argparse.Namespace) -> int:
    from behemoth.errors import Refused
    from behemoth.faults.launch import launch, launched_by_torchrun
    from behemoth.planner.feasibility import launch_problems
    from behemoth.train import train

    nproc = parse_nproc(args.nproc)
    most = nproc[1] if isinstance(nproc, tuple) else nproc
    if "parallel=auto" in args.overrides:  # plan for the processes given (every worker of a torchrun job plans alike)
        from behemoth.cli.plan import auto_overrides

        world = int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else most
        args.overrides = auto_overrides(args.overrides, args.config, world)
    cfg, ckpt = resolve_train_config(args)
    t0 = time.time()
    if launched_by_torchrun():  # torchrun started us: this process is one worker (train() runs the checks)
        try:
            summary = train(cfg, resume=ckpt)
        except BaseException as err:
            fail_fast(err, 2 if isinstance(err, BehemothError) else 1)
        if summary.get("rank") == 0:
            report(summary, time.time() - t0)
        return 0
    found = launch_problems(cfg, most, ckpt) + (elastic_problems(cfg, nproc, args.max_restarts) if isinstance(nproc, tuple) else [])
    if found:  # everything that can be refused without a worker, all at once
        raise Refused(found)
    print(launch_line(cfg, nproc), flush=True)
    if nproc == 1 and args.max_restarts == 0:
        summary = train(cfg, resume=ckpt, verified=True)
    else:
        summary = launch(
            nproc,
            worker,
            cfg.model_dump(mode="json"),
            str(ckpt) if ckpt else None,
            uuid.uuid4().hex,
            timeout_s=cfg.run.timeout_s,
            max_restarts=args.max_restarts,
        )[0]
    report(summary, time.time() - t0)
    return 0


def report(summary: dict[str, Any], seconds: float) -> None:
    val = summary["val"]
    curve = f"validation loss {val[0][1]:.3f} (step {val[0][0]}) -> {val[-1][1]:.3f} (step {val[-1][0]})" if val else ""
    print(f"behemoth: done in {seconds:.0f} s; {curve}")
    if "mfu" in summary:
        print(
            f"behemoth: MFU {100 * summary['mfu']:.1f}% (median step) of a {summary['peak_tflops']:.3g} TFLOP/s peak over all ranks "
            f"({summary['peak_source']})"
        )
    if "compile_s" in summary:  # train.compile: step times and MFU above exclude it
        print(f"behemoth: compiled in {summary['compile_s']:.1f} s (not in step times; cache {summary['compile_cache']})")
    if summary.get("energy") is not None:
        from behemoth.profiler.energy import run_energy_line

        print(f"behemoth: {run_energy_line(summary['energy'])}")
    exported = " model.safetensors" if summary.get("exported", True) else " (no model.safetensors: checkpoint.export=true, or behemoth export)"
    if summary.get("adapter"):  # a LoRA run: its adapters in PEFT's layout (docs/finetune.md)
        exported = " adapter/ (LoRA, PEFT layout; merged weights: behemoth export RUN --merge --out DIR)"
    print(f"behemoth: run directory {summary['run_dir']}: config.yaml metrics.jsonl loss.png checkpoints/{exported}")


def run_export(args: argparse.Namespace) -> int:
    """`behemoth export`: the checkpoint is verified like a resume's, and nothing it holds becomes a traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return export_checkpoint(args)
    except BehemothError:
        raise
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException derives from BaseException
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise BehemothError(f"could not export {args.path}: {err.__class__.__name__}: {first}", "export a checkpoint behemoth wrote") from None


def export_checkpoint(args: argparse.Namespace) -> int:
    from behemoth.faults.checkpoint import export_safetensors, resolve_checkpoint, validate_checkpoint
    from behemoth.models.causal_lm import build_causal_lm
    from behemoth.models.gpt import GPTConfig
    from behemoth.models.hf import HFConfig

    use = "behemoth export {}"
    ckpt = resolve_checkpoint(args.path, use=use)
    saved = validate_checkpoint(ckpt, None, use=use).get("config", {})
    from behemoth.cli.export import export_lora, export_tokenizer, is_lora_run, refuse_merge

    if is_lora_run(saved):  # adapters only: in PEFT's layout, or merged into the base (--merge)
        return export_lora(args, ckpt, saved)
    refuse_merge(args)
    model_cfg, hf_cfg = GPTConfig.model_validate(saved.get("model", {})), HFConfig.model_validate(saved.get("hf", {}))
    if args.hf:
        from behemoth.faults.checkpoint import export_pretrained

        folder = export_pretrained(ckpt, Path(args.hf), build_causal_lm(model_cfg, hf_cfg).module)
        tokenizer = export_tokenizer(saved, ckpt.parent.parent, folder)
        print(f"behemoth: wrote {folder} (transformers save_pretrained layout{tokenizer}) from {ckpt}")
        return 0
    out = Path(args.out) if args.out else ckpt.parent.parent / "model.safetensors"
    export_safetensors(ckpt, out, build_causal_lm(model_cfg, hf_cfg).module)
    print(f"behemoth: wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) from {ckpt}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in delegated_commands():
        return run_delegated(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return exit_code({"train": run_train, "export": run_export}[args.command], args)
    except KeyboardInterrupt:
        print("behemoth: interrupted", file=sys.stderr)
        return 130
