"""ZeRO throughput and memory per rank: behemoth stages 0-3 against torch DDP, FSDP2 and DeepSpeed ZeRO 1-3.

    pip install -e .[bench]            # DeepSpeed, pinned so that torch stays 2.13.0
    python benchmarks/bench_zero.py    # 2 processes, float32, gpt-20m; writes its table into benchmarks/README.md
    python benchmarks/bench_zero.py --compile --no-write   # every system on its compiled path (see below)

Every system trains the same model (behemoth's GPT, initialized from the same (seed, name) values),
on the same batch (`--batch` sequences of `--seq` tokens per step, split over the ranks, one
micro-batch), with AdamW (foreach), global-norm clipping at 1.0 and float32 everywhere. Each system
runs in its own fresh processes; a step is timed between barriers and the median over `--steps`
steps after `--warmup` is kept; with `--rounds` > 1 the systems are run again in turn and each keeps
its best round (other work on the machine only ever slows a round down). Memory per rank is the
process's peak resident set (VmHWM) and its growth from just before the model was built; behemoth
also reports the model-state bytes it counts. glibc keeps freed blocks of up to 32 MiB in its heap once
a large block has been freed (its mmap threshold adapts), which makes the resident set of systems that
allocate and free per-block buffers (ZeRO-3, FSDP2) say little about what they use; all systems
therefore run with MALLOC_MMAP_THRESHOLD_=1 MiB (`--glibc-default` turns this off).

With `--compile` every system takes its own compiled path: behemoth `train.compile=true` (each block compiled), DDP
`torch.compile(DDP(model))` (DDP's optimizer splits the graph at its buckets), FSDP2 each block compiled before
`fully_shard` (torchtitan's order), DeepSpeed `engine.compile()`; at least two warm-up steps hold the compilation, and
the compiled code is kept in a folder of the run's own (removed at the end).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ratios import add_report_args, best_of_rounds, command_line, failure, ratio, write_rows

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SYSTEMS = ["behemoth-0", "torch-ddp", "behemoth-1", "deepspeed-1", "behemoth-2", "deepspeed-2", "behemoth-3", "fsdp2", "deepspeed-3"]
PEERS = {
    "behemoth-0": ["torch-ddp"],
    "behemoth-1": ["deepspeed-1", "torch-ddp"],
    "behemoth-2": ["deepspeed-2", "torch-ddp"],
    "behemoth-3": ["fsdp2", "deepspeed-3"],
}
BEGIN, END = "<!-- bench_zero:begin -->", "<!-- bench_zero:end -->"
FAILED: dict[str, str] = {}  # system -> why it could not run
MiB = 2**20


def proc_status_kb(field: str) -> int:
    """A VmRSS / VmHWM line of /proc/self/status, in KiB."""
    return int(re.search(rf"^{field}:\s+(\d+)", Path("/proc/self/status").read_text(), re.M).group(1))


def build_model(preset: str, seed: int) -> Any:
    """behemoth's GPT with every parameter drawn from (seed, name): the same weights for every system."""
    import torch

    from behemoth.models.gpt import GPTConfig, build_gpt
    from behemoth.models.init import materialize

    model = build_gpt(GPTConfig(preset=preset))
    materialize(model, seed=seed, device=torch.device("cpu"), init_spec=model.init_spec)
    return model


def local_batch(args: dict, rank: int, world: int, vocab: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(args["seed"])
    tokens = torch.randint(0, vocab, (args["batch"], args["seq"] + 1), generator=g)
    mine = tokens[rank * args["batch"] // world : (rank + 1) * args["batch"] // world]
    return mine[:, :-1], mine[:, 1:]


def adamw(params: Any, args: dict) -> Any:
    import torch

    return torch.optim.AdamW(params, lr=args["lr"], betas=(0.9, 0.95), weight_decay=0.1, foreach=True)


def mean_loss(model: Any, x: Any, y: Any) -> Any:
    import torch.nn.functional as F

    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def global_mean(loss: Any) -> float:
    """The batch's mean loss over all ranks (what behemoth's engine reports), for the sanity column."""
    import torch.distributed as dist

    value = loss.detach().clone()
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def behemoth_step(args: dict, stage: int) -> tuple[Callable[[], float], dict]:
    """behemoth's engine exactly as `behemoth train` builds it, at ZeRO `stage` (0: bucketed data parallelism)."""
    import torch.distributed as dist

    from behemoth.config import load_config
    from behemoth.engine import build_engine
    from behemoth.topology import init_runtime

    cfg = load_config(
        None,
        [
            f"model={args['preset']}",
            f"train.global_batch={args['batch']}",
            f"train.seq_len={args['seq']}",
            f"train.seed={args['seed']}",
            f"parallel.zero_stage={stage}",
            f"train.compile={str(args['compile']).lower()}",
        ],
    )
    engine = build_engine(cfg, init_runtime(timeout_s=600))
    batch = [local_batch(args, dist.get_rank(), dist.get_world_size(), cfg.model.vocab_size)]

    def step() -> float:
        return engine.train_step(batch, args["lr"]).loss

    return step, {"model_states_mib": lambda: sum(v for k, v in engine.model_state_bytes().items() if k in ("params", "grads", "optimizer")) / MiB}


def torch_step(args: dict, kind: str) -> tuple[Callable[[], float], dict]:
    """torch DDP, or FSDP2 (`fully_shard` on every block, then the root), with AdamW and global-norm clipping."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(args["preset"], args["seed"])
    if kind == "torch-ddp":
        model = DistributedDataParallel(model)
        net = torch.compile(model) if args["compile"] else model
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            if args["compile"]:
                block.compile()  # in place (module.compile), before sharding, as torchtitan applies it
            fully_shard(block)
        fully_shard(model)
        net = model
    opt = adamw(model.parameters(), args)
    x, y = local_batch(args, dist.get_rank(), dist.get_world_size(), 256)

    def step() -> float:
        opt.zero_grad(set_to_none=False)
        loss = mean_loss(net, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return global_mean(loss)

    return step, {}


def deepspeed_step(args: dict, stage: int) -> tuple[Callable[[], float], dict]:
    """DeepSpeed ZeRO `stage` on its CPU accelerator over the gloo group, with torch's AdamW as client optimizer."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model(args["preset"], args["seed"])
    config = {
        "train_micro_batch_size_per_gpu": args["batch"] // dist.get_world_size(),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters(), args), config=config)
    if args["compile"]:
        engine.compile()  # DeepSpeed's own compiled path (torch.compile of the wrapped module)
    x, y = local_batch(args, dist.get_rank(), dist.get_world_size(), 256)

    def step() -> float:
        loss = mean_loss(engine, x, y)
        engine.backward(loss)
        engine.step()
        return global_mean(loss)

    return step, {}


def run_system(name: str, args: dict) -> dict:
    """One rank: build `name`, time its steps, report tokens/s and memory (runs inside run_ranks)."""
    import torch.distributed as dist

    rss0 = proc_status_kb("VmRSS")
    kind, _, stage = name.rpartition("-")
    if name.startswith("behemoth"):
        step, extra = behemoth_step(args, int(stage))
    elif name.startswith("deepspeed"):
        step, extra = deepspeed_step(args, int(stage))
    else:
        step, extra = torch_step(args, name)
    times, cpu, losses = [], [], []
    for i in range(args["warmup"] + args["steps"]):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        losses.append(step())
        dist.barrier()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    step_s = statistics.median(times[args["warmup"] :])
    out = {
        "tokens_per_s": args["batch"] * args["seq"] / step_s,
        "step_s": step_s,
        "first_loss": losses[0],
        "cpu_s": statistics.median(cpu[args["warmup"] :]),
        "peak_rss_mib": proc_status_kb("VmHWM") / 1024,
        "rss_growth_mib": (proc_status_kb("VmHWM") - rss0) / 1024,
    }
    out.update({k: f() for k, f in extra.items()})
    return out


def measure(systems: list[str], args: dict) -> dict[str, dict]:
    """Each system in fresh processes, `rounds` times in turn (every other round in reverse order); keep each
    system's fastest round, and its least CPU time per step over rounds (memory: rank max)."""
    from behemoth.faults.ranks import run_ranks

    def run(name: str) -> dict:
        ranks = run_ranks(args["nproc"], run_system, name, args, timeout=1800.0, threads=args["threads"])
        return {
            "tokens_per_s": min(x["tokens_per_s"] for x in ranks),
            "first_loss": ranks[0]["first_loss"],
            "cpu_s": max(x["cpu_s"] for x in ranks),
            **{k: max(x[k] for x in ranks) for k in ranks[0] if k.endswith("_mib")},
        }

    def label(row: dict) -> str:
        return f"{row['tokens_per_s']:>9.0f} tokens/s  CPU {row['cpu_s']:.2f} s/step  peak RSS {row['peak_rss_mib']:.0f} MiB  loss {row['first_loss']:.4f}"

    return best_of_rounds(systems, args["rounds"], run, label, FAILED)


def table(results: dict[str, dict], args: dict) -> str:
    """Markdown: every system's throughput and memory, and behemoth's ratio to the peers it is compared with."""
    head = (
        f"{args['nproc']} processes x {args['threads']} thread(s), float32, {args['preset']}, batch {args['batch']} x {args['seq']} tokens "
        f"per step, median of {args['steps']} steps after {args['warmup']}, best of {args['rounds']} round(s) (tokens/s: fastest round; CPU: least)"
        f"{'' if args['glibc_default'] else ', MALLOC_MMAP_THRESHOLD_=1 MiB'}{', every system compiled' if args['compile'] else ''}\n\n"
    )
    rows = [
        "| system | tokens/s | CPU s per step (rank max) | peak RSS per rank (MiB) | RSS growth per rank (MiB) | model states counted (MiB) | first-step loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        states = f"{r['model_states_mib']:.1f}" if "model_states_mib" in r else "-"
        rows.append(
            f"| {name} | {r['tokens_per_s']:.0f} | {r['cpu_s']:.2f} | {r['peak_rss_mib']:.0f} | {r['rss_growth_mib']:.0f} | {states} | {r['first_loss']:.4f} |"
        )
    ratios = [
        "",
        "| behemoth | vs peer | tokens/s ratio (behemoth / peer) | CPU time ratio (peer / behemoth) | RSS growth ratio (behemoth / peer) |",
        "|---|---|---:|---:|---:|",
    ]
    for ours, peers in PEERS.items():
        for peer in peers:
            if ours in results and peer in results:
                a, b = results[ours], results[peer]
                ratios.append(
                    f"| {ours} | {peer} | {a['tokens_per_s'] / b['tokens_per_s']:.2f} | {b['cpu_s'] / a['cpu_s']:.2f} | "
                    f"{a['rss_growth_mib'] / b['rss_growth_mib']:.2f} |"
                )
    return head + "\n".join(rows + ratios) + "\n"


def ratio_rows(results: dict[str, dict], args: dict) -> list[dict]:
    """The table's comparisons as `behemoth bench` rows, and the systems that could not run."""
    case = f"{args['preset']}, {args['nproc']} processes"
    rows = [failure("ZeRO", name, reason) for name, reason in FAILED.items()]
    for ours, peers in PEERS.items():
        for peer in (p for p in peers if ours in results and p in results):
            a, b = results[ours], results[peer]
            rows += [
                ratio("ZeRO", f"{ours}, {case}", peer, "tokens/s", a["tokens_per_s"], b["tokens_per_s"]),
                ratio("ZeRO", f"{ours}, {case}", peer, "CPU s per step", a["cpu_s"], b["cpu_s"], higher_is_better=False),
                ratio("ZeRO", f"{ours}, {case}", peer, "RSS growth per rank", a["rss_growth_mib"], b["rss_growth_mib"], higher_is_better=False),
            ]
    return rows


def write_readme(text: str, command: str) -> Path:
    """Replace this benchmark's section of benchmarks/README.md (other benchmarks' sections are left alone)."""
    path = ROOT / "benchmarks" / "README.md"
    body = f"{BEGIN}\nCommand: `{command}`\n\n{text}{END}"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in old:
        new = old[: old.index(BEGIN)] + body + old[old.index(END) + len(END) :]
    else:
        new = old.rstrip("\n") + "\n\n## ZeRO: behemoth vs DDP, FSDP2, DeepSpeed (`bench_zero.py`)\n\n" + body + "\n"
    path.write_text(new)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt-20m")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="intra-op threads per process")
    p.add_argument("--batch", type=int, default=8, help="sequences per step over all ranks")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--only", default=",".join(SYSTEMS), help="comma-separated systems")
    p.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/README.md alone")
    p.add_argument("--glibc-default", action="store_true", help="keep glibc's adaptive mmap threshold (resident sets then include freed memory)")
    p.add_argument("--compile", action="store_true", help="every system on its compiled path (behemoth train.compile, torch.compile, engine.compile)")
    add_report_args(p)
    a = p.parse_args(argv)
    if a.quick:
        a.steps, a.warmup, a.rounds, a.no_write = 2, 1, 1, True
    if a.compile:
        a.warmup = max(a.warmup, 2)
        cache = tempfile.TemporaryDirectory()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name  # the workers start after this
    if not a.glibc_default:  # read by the worker processes, which start after this
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MiB)
    args = {**vars(a), "seed": 1234, "lr": 1e-3}
    results = measure(a.only.split(","), args)
    text = table(results, args)
    print(text)
    write_rows(a.json, ratio_rows(results, args))
    if not a.no_write:
        print(f"wrote {write_readme(text, command_line('bench_zero.py', argv))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
