"""behemoth pipeline schedules vs torch.distributed.pipelining and DeepSpeed's PipelineModule; measured bubbles vs the simulator.

Same model (a GPT built and initialized by behemoth, cut at the same stage boundaries), same
micro-batching, float32, AdamW with gradient clipping on every side; only the pipeline runtime
differs. The machine is shared, so every variant runs `--rounds` times, interleaved, and each
reports its fastest step (the least disturbed one): tokens/s from it, and from its executor
timestamps the measured bubble fraction, set next to `simulate` fed with that step's median
per-stage pass times and a measured p2p latency, and next to a replay of that step in the
simulator with every pass taking exactly its measured time. Run:

    python benchmarks/bench_pipeline.py [--steps 6] [--warmup 2] [--worlds 2,4] [--readme]
    python benchmarks/bench_pipeline.py --part v [--worlds 2]   # ZBV, DualPipeV, 1F1B-SCP vs 1F1B (+ recompute), vs torch's own
    python benchmarks/bench_pipeline.py --part compiled          # GPipe and 1F1B with every block compiled on both sides

With --readme the tables replace the pipeline section of benchmarks/README.md (`--part v`: its own section).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
from pipeline_tables import COMPILED, TORCH_V, V_PART, format_compiled_table, format_tables, format_v_table, ratio_rows, v_ratio_rows

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
V_BEGIN, V_END = "<!-- bench_pipeline_v: begin -->", "<!-- bench_pipeline_v: end -->"


def make_config(world: int, schedule: str) -> Any:
    """The benchmark's config; `1f1b+recompute`: 1F1B with every block checkpointed (torch.utils.checkpoint)."""
    from behemoth.config import load_config

    name, *extras = schedule.split("+")
    unknown = set(extras) - {"recompute", "compile"}
    if unknown:
        raise ValueError(f"unknown schedule suffix {', '.join(sorted(unknown))} in {schedule!r}")
    options = ["parallel.recompute=full"] * ("recompute" in extras) + ["train.compile=true"] * ("compile" in extras)
    return load_config(None, MODEL + [f"parallel.pp={world}", f"parallel.schedule={name}", *options])


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
    """behemoth's Engine on `world` pipeline ranks: throughput, measured and simulated bubble, stash (`+compile`: each
    block compiled, train.compile=true)."""
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
    meter, before = engine.model.meter, {op: (s.calls, s.bytes) for op, s in engine.model.meter.ops.items()}
    times, cpu = timed_steps(engine.train_step, sampler, steps, warmup, lambda: timelines.append(gather_timelines(pipe.last_trace, pipe.group)))
    sent = [(s.calls - before.get(op, (0, 0))[0], s.bytes - before.get(op, (0, 0))[1]) for op, s in meter.ops.items() if op == "send"]
    s, best = pipe.schedule, timelines[min(range(len(times)), key=times.__getitem__)]  # the least disturbed step
    simulated = simulate(s, measured_costs([best], s, latency))
    return {
        "tokens_per_s": cfg.train.global_batch * cfg.seq_len / min(times),
        "cpu_s": cpu,
        "bubble": measured_bubble(best),
        "simulated": simulated.bubble_fraction,
        "replayed": replayed_bubble(best, s, latency),
        "closed_form": closed_form_bubble(s.name, s.ranks, s.microbatches, s.chunks).bubble_fraction,
        "stash_mb": pipe.last_trace.peak_stash_bytes / 2**20,
        "p2p_ms": latency * 1e3,
        "m": s.microbatches,
        "sends": sum(c for c, _ in sent) / (warmup + steps),  # this rank's messages and bytes sent per step
        "sent_mb": sum(b for _, b in sent) / (warmup + steps) / 2**20,
        "recv_buffers": pipe.executor.buffers.allocated,  # receive buffers this rank made over all its steps (kept, reused)
        "recvs": pipe.executor.buffers.allocated + pipe.executor.buffers.reused,
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
    """torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B, its ScheduleInterleaved1F1B with two stages per rank
    (rank r holds r and r + p, as behemoth's interleaved), or its ScheduleZBVZeroBubble / ScheduleDualPipeV with two
    stages per rank in the same V, on the same stages of the same model (`+compile`: each block compiled in place)."""
    import torch
    from torch.distributed import pipelining as tp

    from behemoth.models.causal_lm import build_causal_lm, summed_token_loss
    from behemoth.models.init import materialize
    from behemoth.parallel.pipeline.partition import cut_model
    from behemoth.parallelize import resolve_stage_boundaries
    from behemoth.topology import init_runtime

    cfg = make_config(world, schedule)
    schedule = schedule.partition("+")[0]
    rt = init_runtime(**cfg.parallel.degrees())
    rank, group, tokens = rt.coordinate("pp"), rt.group("pp"), cfg.train.global_batch * cfg.seq_len
    lm = build_causal_lm(cfg.model)
    for block in lm.module.blocks if cfg.train.compile else ():
        block.compile()  # the peer's compiled path: each block in place, before the stages are built (torchtitan's order)
    model, stages = lm.module, 2 * world if schedule in ("zbv", "dualpipev", "interleaved") else world
    held = [rank] if stages == world else [rank, rank + world] if schedule == "interleaved" else [rank, stages - 1 - rank]
    parts = cut_model(model, held, resolve_stage_boundaries(cfg.parallel, lm, cfg.seq_len, 0), lm.layers)
    materialize(model, seed=cfg.train.seed, device=rt.device, init_spec=model.init_spec)

    class StageModule(torch.nn.Module):
        """One stage's parameters (and only those: torch's weight pass differentiates them) and its forward."""

        def __init__(self, part) -> None:
            super().__init__()
            self.part, self.params = part, torch.nn.ParameterList(part.parameters())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.part.forward(x)

    torch_stages = [tp.PipelineStage(StageModule(parts[s]), s, stages, rt.device, group=group) for s in held]
    kind = {
        "gpipe": tp.ScheduleGPipe,
        "1f1b": tp.Schedule1F1B,
        "interleaved": tp.ScheduleInterleaved1F1B,
        "zbv": tp.ScheduleZBVZeroBubble,
        "dualpipev": tp.ScheduleDualPipeV,
    }[schedule]
    loss = lambda out, y: summed_token_loss(out, y) / tokens  # noqa: E731
    pipe = kind(torch_stages if stages > world else torch_stages[0], n_microbatches=cfg.parallel.microbatches, loss_fn=loss, scale_grads=False)
    from peers import plain_adamw

    optimizer = plain_adamw(model, cfg.train)
    first, last = 0 in held, stages - 1 in held

    def step(batches, lr):
        optimizer.zero_grad(set_to_none=False)
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        pipe.step(*([x] if first else []), **({"target": y} if last else {}))
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


def run_v(worlds: list[int], steps: int, warmup: int, rounds: int, pairs: list[tuple[str, str]] | None = None) -> dict[tuple[int, str, str], dict]:
    """`--part v`: behemoth's V_PART and torch's TORCH_V (or the (runtime, schedule) `pairs` given), `rounds` times
    interleaved, each one's fastest run kept; a peer that fails keeps its error's last line."""
    from behemoth.faults.ranks import run_ranks

    bodies = {"behemoth": behemoth_rank, "torch": torch_rank}
    best: dict[tuple[int, str, str], dict] = {}
    pairs = pairs or [("behemoth", s) for s in V_PART] + [("torch", s) for s in TORCH_V]
    for round_ in range(rounds):
        for world in worlds:
            for runtime, schedule in pairs:
                key = (world, runtime, schedule)
                try:
                    got = run_ranks(world, bodies[runtime], schedule, world, steps, warmup, timeout=1800)
                except AssertionError as err:
                    best.setdefault(key, {"error": [x for x in str(err).splitlines() if x.strip()][-1][:160]})
                    continue
                result = {**got[0], "stash": [r.get("stash_mb") for r in got], "cpu_s": sum(r["cpu_s"] for r in got)}
                cpu = min(result["cpu_s"], best[key].get("cpu_s", result["cpu_s"])) if key in best else result["cpu_s"]
                if "tokens_per_s" not in best.get(key, {}) or result["tokens_per_s"] > best[key]["tokens_per_s"]:
                    best[key] = result
                best[key]["cpu_s"] = cpu  # the least CPU work any round needed for a step
                print(f"  round {round_ + 1}: p={world} {runtime} {schedule}: {result['tokens_per_s']:.0f} tok/s", file=sys.stderr, flush=True)
    return best


C_BEGIN, C_END = "<!-- bench_pipeline_compiled: begin -->", "<!-- bench_pipeline_compiled: end -->"


def write_readme(text: str, markers: tuple[str, str] = (BEGIN, END), title: str = "Pipeline parallelism (bench_pipeline.py)") -> None:
    """Replace the text between the markers in benchmarks/README.md (append the section if missing)."""
    begin, end = markers
    old = README.read_text() if README.exists() else "# Benchmarks\n"
    block = f"{begin}\n{text}\n{end}"
    if begin in old:
        new = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: block, old, flags=re.S)
    else:
        new = old.rstrip("\n") + f"\n\n## {title}\n\n" + block + "\n"
    README.write_text(new)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every variant, interleaved; the fastest is kept")
    parser.add_argument("--readme", action="store_true", help="write the tables into benchmarks/README.md")
    parser.add_argument(
        "--part", choices=["all", "v", "compiled"], default="all", help="v: ZBV, DualPipeV and 1F1B-SCP only; compiled: GPipe and 1F1B, both compiled"
    )
    from ratios import add_report_args, command_line, write_rows

    add_report_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds, args.worlds = 2, 1, 1, "2"
    command = command_line("bench_pipeline.py", argv)
    if args.part in ("v", "compiled"):
        worlds = [int(w) for w in args.worlds.split(",")]
        pairs = [(r, s) for s in COMPILED for r in ("behemoth", "torch")] if args.part == "compiled" else None
        best = run_v(worlds, args.steps, args.warmup, args.rounds, pairs)
        table = format_compiled_table if args.part == "compiled" else format_v_table
        text = table(best, worlds, command.strip())
        print(text)
        write_rows(args.json, v_ratio_rows(best))
        if args.readme and args.part == "compiled":
            write_readme(text, (C_BEGIN, C_END), "Pipeline parallelism, both compiled (bench_pipeline.py --part compiled)")
        elif args.readme:
            write_readme(text, (V_BEGIN, V_END), "Pipeline schedules: ZBV, DualPipeV, 1F1B-SCP (bench_pipeline.py --part v)")
        return 0
    throughput, bubbles = run([int(w) for w in args.worlds.split(",")], args.steps, args.warmup, args.rounds)
    text = format_tables(throughput, bubbles, command.strip())
    print(text)
    write_rows(args.json, ratio_rows(throughput, bubbles))
    if args.readme:
        write_readme(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
