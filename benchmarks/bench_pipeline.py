"""behemoth pipeline schedules vs torch.distributed.pipelining and DeepSpeed's PipelineModule; measured bubbles vs the simulator.

Same model (a GPT built and initialized by behemoth, cut at the same stage boundaries), same
micro-batching, float32, AdamW with gradient clipping on every side; only the pipeline runtime
differs. The machine is shared, so every variant runs `--rounds` times, interleaved, and each
reports its fastest step (the least disturbed one): tokens/s from it, and from its executor
timestamps the measured bubble fraction, set next to `simulate` fed with that step's median
per-stage pass times and a measured p2p latency, and next to a replay of that step in the
simulator with every pass taking exactly its measured time. Run:

    python benchmarks/bench_pipeline.py [--steps 6] [--warmup 2] [--worlds 2,4] [--readme]

With --readme the tables replace the pipeline section of benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

MODEL = [
    "model=gpt-1m",
    "model.n_layer=8",
    "model.d_model=128",
    "model.n_head=4",
    "model.context=128",
    "train.seq_len=128",
    "train.global_batch=16",
    "parallel.microbatches=8",
    "run.progress=false",
    "run.timeout_s=300",
]
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "chimera"]
README = Path(__file__).with_name("README.md")
BEGIN, END = "<!-- bench_pipeline: begin -->", "<!-- bench_pipeline: end -->"


def make_config(world: int, schedule: str) -> Any:
    from behemoth.config import load_config

    return load_config(None, MODEL + [f"parallel.pp={world}", f"parallel.schedule={schedule}"])


def data(cfg: Any):
    from behemoth.data import BatchSampler, prepare_corpus
    from behemoth.topology import ParallelDims

    corpus = prepare_corpus(cfg.data.path, cfg.data.val_fraction, cfg.data.cache_dir)
    return BatchSampler(corpus.train, cfg.seq_len, cfg.batch_layout(ParallelDims(1)), 0, cfg.train.seed)


def timed_steps(step_fn, sampler, steps: int, warmup: int, after_step=None) -> tuple[list[float], float]:
    """Wall seconds of each timed step (all ranks start each step together), and this process's median CPU
    seconds per step (all its threads: the work done, which waiting for a core or a message does not add to)."""
    import torch.distributed as dist

    times, cpu = [], []
    for step in range(warmup + steps):
        batches = sampler.micro_batches(step)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step_fn(batches, 1e-3)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if after_step is not None and step >= warmup:
            after_step()
    return times[warmup:], sorted(cpu[warmup:])[len(cpu[warmup:]) // 2]


def p2p_latency(group, hidden_shape: tuple[int, ...], reps: int = 20) -> float:
    """One-way time of an activation-sized message between pipeline ranks 0 and 1 (half a round trip)."""
    import torch
    import torch.distributed as dist

    rank, x = dist.get_rank(group), torch.zeros(hidden_shape)
    dist.barrier(group)
    t0 = time.perf_counter()
    for _ in range(reps):
        if rank == 0:
            dist.send(x, dist.get_global_rank(group, 1), group=group)
            dist.recv(x, dist.get_global_rank(group, 1), group=group)
        elif rank == 1:
            dist.recv(x, dist.get_global_rank(group, 0), group=group)
            dist.send(x, dist.get_global_rank(group, 0), group=group)
    box = [(time.perf_counter() - t0) / (2 * reps)]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def behemoth_rank(schedule: str, world: int, steps: int, warmup: int) -> dict[str, Any]:
    """behemoth's Engine on `world` pipeline ranks: throughput, measured and simulated bubble, stash."""
    from behemoth.engine import build_engine
    from behemoth.parallel.pipeline import closed_form_bubble, simulate
    from behemoth.parallel.pipeline.analysis.measure import gather_timelines, measured_bubble, measured_costs, replayed_bubble
    from behemoth.topology import init_runtime

    cfg = make_config(world, schedule)
    rt = init_runtime(**cfg.parallel.degrees())
    engine, sampler = build_engine(cfg, rt), data(cfg)
    pipe = engine.model.pipeline
    latency = p2p_latency(pipe.group, (cfg.train.global_batch // cfg.parallel.microbatches, cfg.seq_len, cfg.model.d_model))
    timelines: list = []
    times, cpu = timed_steps(engine.train_step, sampler, steps, warmup, lambda: timelines.append(gather_timelines(pipe.last_trace, pipe.group)))
    s, best = pipe.schedule, timelines[min(range(len(times)), key=times.__getitem__)]  # the least disturbed step
    simulated = simulate(s, measured_costs([best], s, latency))
    return {
        "tokens_per_s": cfg.train.global_batch * cfg.seq_len / min(times),
        "cpu_s": cpu,
        "bubble": measured_bubble(best),
        "simulated": simulated.bubble_fraction,
        "replayed": replayed_bubble(best, s, latency),
        "closed_form": closed_form_bubble(schedule, s.ranks, s.microbatches, s.chunks).bubble_fraction,
        "stash_mb": pipe.last_trace.peak_stash_bytes / 2**20,
        "p2p_ms": latency * 1e3,
        "m": s.microbatches,
    }


def _clip_and_step(model, optimizer, group, max_norm: float) -> None:
    """Clip by the norm over the whole pipeline (each rank holds distinct parameters), then step: as behemoth does."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm_sq = torch.stack(torch._foreach_norm(grads)).square().sum()
    dist.all_reduce(norm_sq, group=group)
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm_sq.sqrt() + 1e-6), max=1.0))
    optimizer.step()


def torch_rank(schedule: str, world: int, steps: int, warmup: int) -> dict[str, Any]:
    """torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B on the same stages of the same model."""
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from behemoth.models.causal_lm import build_causal_lm, summed_token_loss
    from behemoth.models.init import materialize
    from behemoth.parallel.pipeline.partition import cut_model
    from behemoth.parallelize import resolve_stage_boundaries
    from behemoth.topology import init_runtime

    cfg = make_config(world, schedule)
    rt = init_runtime(**cfg.parallel.degrees())
    rank, group, tokens = rt.coordinate("pp"), rt.group("pp"), cfg.train.global_batch * cfg.seq_len
    lm = build_causal_lm(cfg.model)
    model = lm.module
    part = cut_model(model, [rank], resolve_stage_boundaries(cfg.parallel, lm, cfg.seq_len, 0), lm.layers)[rank]
    materialize(model, seed=cfg.train.seed, device=rt.device, init_spec=model.init_spec)

    class StageModule(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return part.forward(x)

    stage = PipelineStage(StageModule(), rank, world, rt.device, group=group)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    pipe = kind(stage, n_microbatches=cfg.parallel.microbatches, loss_fn=lambda out, y: summed_token_loss(out, y) / tokens, scale_grads=False)
    from peers import plain_adamw

    optimizer = plain_adamw(model, cfg.train)

    def step(batches, lr):
        optimizer.zero_grad(set_to_none=False)
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        pipe.step(x) if rank == 0 else pipe.step(target=y) if rank == world - 1 else pipe.step()
        _clip_and_step(model, optimizer, group, cfg.train.grad_clip)

    times, cpu = timed_steps(step, data(cfg), steps, warmup)
    return {"tokens_per_s": tokens / min(times), "cpu_s": cpu}


def deepspeed_rank(schedule: str, world: int, steps: int, warmup: int) -> dict[str, Any]:
    """DeepSpeed's PipelineModule + PipelineEngine (its 1F1B TrainSchedule) on the same layers and micro-batching."""
    import logging

    import deepspeed
    from deepspeed.pipe import PipelineModule

    from behemoth.models.causal_lm import summed_token_loss
    from behemoth.models.gpt import build_gpt
    from behemoth.models.init import materialize
    from behemoth.topology import init_runtime

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    cfg = make_config(world, schedule)
    rt = init_runtime(**cfg.parallel.degrees())
    deepspeed.init_distributed(dist_backend="gloo")
    tokens, m = cfg.train.global_batch * cfg.seq_len, cfg.parallel.microbatches
    model = build_gpt(cfg.model)
    materialize(model, seed=cfg.train.seed, device=rt.device, init_spec=model.init_spec)
    layers = [Embedding(model), *model.blocks, Head(model)]
    net = PipelineModule(
        layers=layers, num_stages=world, partition_method="type:Block", loss_fn=lambda out, y: summed_token_loss(out, y) / tokens * m
    )  # DeepSpeed divides by m itself
    ds_config = {
        "train_micro_batch_size_per_gpu": cfg.train.global_batch // m,
        "gradient_accumulation_steps": m,
        "gradient_clipping": cfg.train.grad_clip,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    from peers import plain_adamw

    engine, *_ = deepspeed.initialize(model=net, optimizer=plain_adamw(net, cfg.train), config=ds_config)

    def step(batches, lr):
        engine.train_batch(data_iter=iter(batches))

    times, cpu = timed_steps(step, data(cfg), steps, warmup)
    return {"tokens_per_s": tokens / min(times), "cpu_s": cpu}


class Embedding(torch.nn.Module):
    """The GPT's token and position embedding as one layer (for DeepSpeed's list of layers)."""

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = gpt.wte, gpt.wpe, gpt.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))


class Head(torch.nn.Module):
    """The GPT's final norm and language-model head as one layer."""

    def __init__(self, gpt: torch.nn.Module) -> None:
        super().__init__()
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(h))


def deepspeed_available() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:  # not installed, or fails to import on this machine
        return False
    return True


def variants(world: int) -> list[tuple[str, str]]:
    """(runtime, schedule) pairs measured at `world` processes."""
    peers = [("torch", "gpipe"), ("torch", "1f1b")] + ([("deepspeed", "1f1b")] if deepspeed_available() else [])
    return [("behemoth", s) for s in SCHEDULES] + peers


def run(worlds: list[int], steps: int, warmup: int, rounds: int) -> tuple[list[dict], list[dict]]:
    """Every variant `rounds` times, interleaved, keeping each one's fastest run (the machine is shared)."""
    from behemoth.faults.ranks import run_ranks

    bodies = {"behemoth": behemoth_rank, "torch": torch_rank, "deepspeed": deepspeed_rank}
    best: dict[tuple[int, str, str], dict] = {}
    for round_ in range(rounds):
        for world in worlds:
            for runtime, schedule in variants(world):
                got = run_ranks(world, bodies[runtime], schedule, world, steps, warmup, timeout=1800)
                result = {**got[0], "stash": [r.get("stash_mb") for r in got], "cpu_s": sum(r["cpu_s"] for r in got)}
                key = (world, runtime, schedule)
                cpu = min(result["cpu_s"], best[key]["cpu_s"]) if key in best else result["cpu_s"]
                if key not in best or result["tokens_per_s"] > best[key]["tokens_per_s"]:
                    best[key] = result
                best[key]["cpu_s"] = cpu  # the least CPU work any round needed for a step
                print(f"  round {round_ + 1}: p={world} {runtime} {schedule}: {result['tokens_per_s']:.0f} tok/s", file=sys.stderr, flush=True)
    throughput = [
        {
            "world": w,
            "schedule": s,
            **{
                f"{side}{k}": best[(w, name, s)][key] if (w, name, s) in best else None
                for side, name in (("ours", "behemoth"), ("torch", "torch"), ("deepspeed", "deepspeed"))
                for k, key in (("", "tokens_per_s"), ("_cpu", "cpu_s"))
            },
        }
        for w in worlds
        for s in ("gpipe", "1f1b")
    ]
    bubbles = [{"world": w, "schedule": s, **best[(w, "behemoth", s)]} for w in worlds for s in SCHEDULES]
    return throughput, bubbles


def format_tables(throughput: list[dict], bubbles: list[dict], command: str) -> str:
    lines = [
        f"`{command}` — GPT with 8 blocks, d_model 128, 4 heads, 128 tokens, 16 sequences per step in 8 micro-batches "
        "of 2, float32, one thread per process; tokens/s of the fastest step over all rounds, CPU seconds of the "
        "least-work round's median step summed over ranks.",
        "",
        "| processes | schedule | behemoth tok/s | torch.distributed.pipelining tok/s | ratio | DeepSpeed PipelineModule tok/s | ratio "
        "| CPU s/step, all ranks: behemoth / torch / DeepSpeed | CPU ratio torch / behemoth | DeepSpeed / behemoth |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in throughput:
        ds = f"{r['deepspeed']:.0f} | {r['ours'] / r['deepspeed']:.2f}" if r["deepspeed"] else "— | —"
        cpu = f"{r['ours_cpu']:.2f} / {r['torch_cpu']:.2f} / " + (f"{r['deepspeed_cpu']:.2f}" if r["deepspeed"] else "—")
        ds_cpu = f"{r['deepspeed_cpu'] / r['ours_cpu']:.2f}" if r["deepspeed"] else "—"
        lines.append(
            f"| {r['world']} | {r['schedule']} | {r['ours']:.0f} | {r['torch']:.0f} | {r['ours'] / r['torch']:.2f} | {ds} "
            f"| {cpu} | {r['torch_cpu'] / r['ours_cpu']:.2f} | {ds_cpu} |"
        )
    lines += [
        "",
        "| processes | schedule | m | tok/s | measured bubble | simulated (median pass times) | measured - simulated "
        "| replayed (each pass's own time) | closed form (uniform) | p2p ms | peak stash MB per rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in bubbles:
        stash = " / ".join(f"{x:.1f}" for x in r["stash"])
        lines.append(
            f"| {r['world']} | {r['schedule']} | {r['m']} | {r['tokens_per_s']:.0f} | {r['bubble']:.3f} | {r['simulated']:.3f} "
            f"| {r['bubble'] - r['simulated']:+.3f} | {r['replayed']:.3f} | {r['closed_form']:.3f} | {r['p2p_ms']:.3f} | {stash} |"
        )
    return "\n".join(lines)


def write_readme(text: str) -> None:
    """Replace the text between the pipeline markers in benchmarks/README.md (append the section if missing)."""
    old = README.read_text() if README.exists() else "# Benchmarks\n"
    block = f"{BEGIN}\n{text}\n{END}"
    if BEGIN in old:
        new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, old, flags=re.S)
    else:
        new = old.rstrip("\n") + "\n\n## Pipeline parallelism (bench_pipeline.py)\n\n" + block + "\n"
    README.write_text(new)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every variant, interleaved; the fastest is kept")
    parser.add_argument("--readme", action="store_true", help="write the tables into benchmarks/README.md")
    from ratios import add_report_args, command_line, write_rows

    add_report_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds, args.worlds = 2, 1, 1, "2"
    command = command_line("bench_pipeline.py", argv)
    throughput, bubbles = run([int(w) for w in args.worlds.split(",")], args.steps, args.warmup, args.rounds)
    text = format_tables(throughput, bubbles, command.strip())
    print(text)
    write_rows(args.json, ratio_rows(throughput, bubbles))
    if args.readme:
        write_readme(text)
    return 0


def ratio_rows(throughput: list[dict], bubbles: list[dict]) -> list[dict]:
    """`behemoth bench` rows: behemoth vs torch.distributed.pipelining and DeepSpeed, and every schedule vs 1F1B."""
    from ratios import ratio

    out = []
    for r in throughput:
        case = f"{r['schedule']}, p={r['world']}"
        for peer, name in (("torch", "torch.distributed.pipelining"), ("deepspeed", "DeepSpeed PipelineModule")):
            if r[peer]:
                out += [
                    ratio("pipeline", case, name, "tokens/s", r["ours"], r[peer]),
                    ratio("pipeline", case, name, "CPU s per step", r["ours_cpu"], r[f"{peer}_cpu"], higher_is_better=False),
                ]
    base = {b["world"]: b for b in bubbles if b["schedule"] == "1f1b"}
    for b in bubbles:
        if b["schedule"] != "1f1b":
            out.append(
                ratio(
                    "pipeline schedules",
                    f"{b['schedule']}, p={b['world']}",
                    "behemoth 1f1b",
                    "tokens/s",
                    b["tokens_per_s"],
                    base[b["world"]]["tokens_per_s"],
                )
            )
    return out


if __name__ == "__main__":
    sys.exit(main())
