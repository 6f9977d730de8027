"""Mixture of experts: behemoth's expert parallelism vs DeepSpeed-MoE; dropless vs capacity; adaptive vs fixed layouts.

    pip install -e .[bench]              # DeepSpeed, pinned so that torch stays 2.13.0
    python benchmarks/bench_moe.py       # 2 and 4 processes; writes its tables into benchmarks/README.md
    python benchmarks/bench_moe.py --quick   # a minute or two: 2 processes, a small model, few steps; prints only

1. behemoth vs DeepSpeed (`deepspeed.moe.layer.MoE` inside the same GPT, DeepSpeed's engine, ZeRO stage 0) on
   `--nproc` processes with ep = nproc: the same GPT-MoE (an MoE MLP every 2nd block, 8 experts, top-2), the same
   weights (behemoth's (seed, name) draw, copied into DeepSpeed's router and experts), the same batch, the same
   gating (capacity factor 1.25 over each rank's micro-batch with DeepSpeed's capacity definition and min_capacity
   4, gates renormalized over the kept choices, no random token selection or second-expert sampling, aux loss
   0.01). Reported: tokens/s (median step), all-to-all bytes a rank sends per step (behemoth's meter; DeepSpeed's
   `all_to_all_single` wrapped and counted the same way: rows leaving the rank), peak resident memory per rank,
   and the first step's loss, which must agree.
2. behemoth dropless vs capacity 1.0 and 1.25 (ep = 2): tokens/s, fraction of assignments dropped, all-to-all bytes.
3. behemoth's adaptive expert layout (probe, cost model) vs each fixed layout (all-to-all with pipelining 1, 2, 4;
   expert gather) on a routing that shifts during training: the first half of the steps route evenly, the second
   half sends most tokens to the experts of rank 0 (a bias on the router's logits, the stand-in for a router whose
   preferences move). Reported: tokens/s over the run, the layouts the adaptive runs chose, and how far each run's
   losses moved from the unpipelined all-to-all's. Layouts compute the same thing (the equivalence tests hold each to
   the single-process curve), but a layout that cuts the rows differently sums weight gradients in another order, and
   over many steps float32 rounding grows through Adam's normalized first steps and routing decisions near a tie.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ratios import command_line, ratio, write_rows  # noqa: E402

ROWS: list[dict[str, Any]] = []  # the comparisons, for `behemoth bench` (--json)

BEGIN, END = "<!-- bench_moe:begin -->", "<!-- bench_moe:end -->"
MiB = 2**20
FULL = {
    "model": ["model=gpt-moe-1m", "model.d_model=256", "model.n_head=8", "model.context=256", "model.moe.experts=8"],
    "batch": 16,
    "seq": 256,
    "steps": 6,
    "warmup": 2,
    "nprocs": [2, 4],
    "shift_steps": 24,
    "probe_every": 8,
}
QUICK = {
    "model": ["model=gpt-moe-1m", "model.n_layer=2", "model.context=64", "model.moe.experts=8"],
    "batch": 8,
    "seq": 64,
    "steps": 3,
    "warmup": 1,
    "nprocs": [2],
    "shift_steps": 10,
    "probe_every": 4,
}
GATING = [
    "model.moe.top_k=2",
    "model.moe.capacity_factor=1.25",
    "model.moe.group=null",
    "model.moe.normalize=kept",
    "model.moe.min_capacity=4",
    "model.moe.aux_coef=0.01",
    "model.moe.z_coef=0",
]
LAYOUTS = {
    "alltoall/1": ["parallel.expert_layout=alltoall"],
    "alltoall/2": ["parallel.expert_chunks=2"],
    "alltoall/4": ["parallel.expert_chunks=4"],
    "gather": ["parallel.expert_layout=gather"],
    "adaptive-probe": ["parallel.expert_adapt=probe"],
    "adaptive-cost": ["parallel.expert_adapt=cost"],
}


def peak_rss_mib() -> float:
    return int(re.search(r"^VmHWM:\s+(\d+)", Path("/proc/self/status").read_text(), re.M).group(1)) / 1024


def config(args: dict, extra: list[str]) -> Any:
    from behemoth.config import load_config

    return load_config(
        None,
        [
            *args["model"],
            f"train.global_batch={args['batch']}",
            f"train.seq_len={args['seq']}",
            "train.seed=1234",
            f"train.lr={args['lr']}",
            "run.progress=false",
            *extra,
        ],
    )


def local_batch(args: dict, rank: int, world: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, 256, (args["batch"], args["seq"] + 1), generator=g)
    mine = tokens[rank * args["batch"] // world : (rank + 1) * args["batch"] // world]
    return mine[:, :-1], mine[:, 1:]


def behemoth_system(args: dict, extra: list[str]) -> tuple[Any, Any]:
    """behemoth's engine as `behemoth train` builds it; its step and the bytes its all-to-alls sent so far."""
    import torch.distributed as dist

    from behemoth.engine import build_engine
    from behemoth.topology import init_runtime

    cfg = config(args, extra)
    rt = init_runtime(timeout_s=600, **cfg.parallel.degrees())
    engine = build_engine(cfg, rt)
    data = rt.data_group()  # the ranks that see different tokens (dp x ep); tp ranks share theirs
    batch = [local_batch(args, dist.get_rank(data), dist.get_world_size(data))]
    state = {"metrics": {}}

    def step(i: int) -> float:
        result = engine.train_step(batch, args["lr"])
        state["metrics"] = result.metrics
        return result.loss

    sent = lambda: engine.model.meter.ops["all_to_all"].bytes if "all_to_all" in engine.model.meter.ops else 0  # noqa: E731
    return step, {"sent": sent, "engine": engine, "state": state}


class DeepSpeedMLP:
    """Builds a `deepspeed.moe.layer.MoE` holding the same router and (this rank's) experts as a behemoth MoE layer."""

    @staticmethod
    def build(layer: Any, ep: int, rank: int) -> Any:
        import torch
        from deepspeed.moe.layer import MoE
        from torch import nn

        E = layer.spec.num_experts
        w_in, w_out = layer.expert_weights()
        ffn, d = w_in.shape[1], w_in.shape[2]
        expert = nn.Sequential(nn.Linear(d, ffn, bias=False), nn.GELU(approximate="tanh"), nn.Linear(ffn, d, bias=False))
        moe = MoE(
            d,
            expert,
            num_experts=E,
            ep_size=ep,
            k=layer.policy.top_k,
            capacity_factor=layer.policy.capacity_factor,
            eval_capacity_factor=layer.policy.capacity_factor,
            min_capacity=layer.policy.min_capacity,
            drop_tokens=True,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        with torch.no_grad():
            moe.deepspeed_moe.gate.wg.weight.copy_(layer.router.weight)
            local = E // ep
            for i, module in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
                module[0].weight.copy_(w_in[rank * local + i])
                module[2].weight.copy_(w_out[rank * local + i])
        return moe


def deepspeed_system(args: dict, extra: list[str]) -> tuple[Any, Any]:
    """The same GPT-MoE with DeepSpeed's MoE layers, trained by DeepSpeed's engine (ZeRO 0, its expert-aware reduction)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.comm as ds_comm
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from behemoth.models.gpt import build_gpt
    from behemoth.models.init import materialize
    from benchmarks.peers import plain_adamw

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = config(args, extra)
    world, rank = dist.get_world_size(), dist.get_rank()
    model = build_gpt(cfg.model)
    materialize(model, seed=cfg.train.seed, device=torch.device("cpu"), init_spec=model.init_spec)
    aux: list[Any] = []

    class Wrapped(nn.Module):
        def __init__(self, moe: Any) -> None:
            super().__init__()
            self.moe = moe

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, l_aux, _ = self.moe(x)
            aux.append(l_aux)
            return out

    for block in model.blocks:
        if hasattr(block.mlp, "router"):
            block.mlp = Wrapped(DeepSpeedMLP.build(block.mlp, world, rank))
    counted = {"bytes": 0}
    inner = ds_comm.all_to_all_single

    def metered(output, tensor, *a, **kw):  # rows leaving this rank, as behemoth's meter counts them
        counted["bytes"] += tensor.numel() * tensor.element_size() * (world - 1) // world
        return inner(output, tensor, *a, **kw)

    ds_comm.all_to_all_single = metered
    ds_config = {
        "train_micro_batch_size_per_gpu": args["batch"] // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=plain_adamw(model, cfg.train), config=ds_config)
    x, y = local_batch(args, rank, world)

    def step(i: int) -> float:
        aux.clear()
        loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
        engine.backward(loss + cfg.model.moe.aux_coef * sum(aux))
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return float(mean) / world

    return step, {"sent": lambda: counted["bytes"]}


def shift_routing(engine: Any, args: dict) -> Any:
    """Make the routing move: from step `shift_steps / 2` on, a bias sends most tokens to the experts of ep rank 0."""
    import torch

    bias = {"value": None}
    for layer in engine.model.experts.layers.values():
        E = layer.spec.num_experts
        skew = torch.zeros(E)
        skew[: E // engine.model.experts.ep.size] = 3.0
        original = layer.router_logits
        layer.router_logits = lambda t, original=original, skew=skew: original(t) + (skew if bias["value"] else 0.0)

    def at_step(i: int) -> None:
        bias["value"] = i >= args["shift_steps"] // 2

    return at_step


def run_system(kind: str, args: dict, extra: list[str]) -> dict:
    """One rank: build the system, time its steps, report (runs inside run_ranks)."""
    import torch.distributed as dist

    step, info = deepspeed_system(args, extra) if kind == "deepspeed" else behemoth_system(args, extra)
    steps = args["shift_steps"] if kind == "shifting" else args["warmup"] + args["steps"]
    at_step = shift_routing(info["engine"], args) if kind == "shifting" else (lambda i: None)
    times, losses, sent, dropped = [], [], [], []
    for i in range(steps):
        at_step(i)
        dist.barrier()
        before, t0 = info["sent"](), time.perf_counter()
        losses.append(step(i))
        dist.barrier()
        times.append(time.perf_counter() - t0)
        sent.append(info["sent"]() - before)
        if "state" in info:
            dropped.append(info["state"]["metrics"].get("dropped_fraction", 0.0))
    timed = times if kind == "shifting" else times[args["warmup"] :]
    out = {
        "step_s": statistics.median(timed),
        "total_s": sum(timed),
        "losses": losses,
        "sent_mib": statistics.median(sent) / MiB,
        "peak_rss_mib": peak_rss_mib(),
        "dropped": statistics.mean(dropped) if dropped else None,
        "moved_mib": sum(v for k, v in info.get("state", {}).get("metrics", {}).items() if k.startswith(("offload_read_mb", "offload_written_mb"))),
    }
    adapter = info["engine"].model.adapter if "engine" in info else None
    if adapter is not None:
        out["chosen"] = [f"{c[0]}/{c[1]}@{s}" for s, c in adapter.history]
    return out


def measure(kind: str, nproc: int, args: dict, extra: list[str], label: str) -> dict:
    from behemoth.faults.ranks import run_ranks

    ranks = run_ranks(nproc, run_system, kind, args, extra, timeout=3600.0, threads=args["threads"])
    row = {
        "label": label,
        "nproc": nproc,
        "tokens_per_s": args["batch"] * args["seq"] / max(r["step_s"] for r in ranks),
        "run_tokens_per_s": args["batch"] * args["seq"] * len(ranks[0]["losses"]) / max(r["total_s"] for r in ranks),
        "sent_mib": max(r["sent_mib"] for r in ranks),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
        "losses": ranks[0]["losses"],
        "dropped": ranks[0]["dropped"],
        "chosen": ranks[0].get("chosen"),
        "moved_mib": max(r["moved_mib"] for r in ranks),
    }
    print(
        f"{label:<34} {row['tokens_per_s']:>9.0f} tokens/s  a2a {row['sent_mib']:.2f} MiB/step  peak RSS {row['peak_rss_mib']:.0f} MiB  "
        f"first loss {row['losses'][0]:.5f}" + (f"  dropped {row['dropped']:.3f}" if row["dropped"] is not None else ""),
        flush=True,
    )
    return row


def versus_deepspeed(args: dict) -> str:
    rows = [
        "| processes (ep) | system | tokens/s | tokens/s ratio (behemoth / DeepSpeed) | all-to-all MiB sent per rank per step | "
        "peak RSS per rank (MiB) | first-step loss |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for n in args["nprocs"]:
        ours = measure("behemoth", n, args, [*GATING, f"parallel.ep={n}"], f"behemoth ep={n}")
        peer = measure("deepspeed", n, args, GATING, f"deepspeed ep={n}")
        for r in (ours, peer):
            value = f"{ours['tokens_per_s'] / peer['tokens_per_s']:.2f}" if r is ours else ""
            rows.append(
                f"| {n} | {r['label'].split()[0]} | {r['tokens_per_s']:.0f} | {value} | {r['sent_mib']:.2f} | "
                f"{r['peak_rss_mib']:.0f} | {r['losses'][0]:.6f} |"
            )
        case = f"{' '.join(args['model'])}, ep={n}"
        ROWS.extend(
            [
                ratio("mixture of experts", case, "DeepSpeed-MoE", "tokens/s", ours["tokens_per_s"], peer["tokens_per_s"]),
                ratio(
                    "mixture of experts",
                    case,
                    "DeepSpeed-MoE",
                    "peak RSS per rank",
                    ours["peak_rss_mib"],
                    peer["peak_rss_mib"],
                    higher_is_better=False,
                ),
            ]
        )
    return "\n".join(rows) + "\n"


def dropless_vs_capacity(args: dict) -> str:
    rows = ["| routing (ep=2) | tokens/s | assignments dropped | all-to-all MiB sent per rank per step |", "|---|---:|---:|---:|"]
    for label, extra in (
        ("dropless", []),
        ("capacity 1.0", ["model.moe.capacity_factor=1.0"]),
        ("capacity 1.25", ["model.moe.capacity_factor=1.25"]),
    ):
        r = measure("behemoth", 2, args, ["parallel.ep=2", *extra], label)
        rows.append(f"| {label} | {r['tokens_per_s']:.0f} | {r['dropped']:.3f} | {r['sent_mib']:.2f} |")
    return "\n".join(rows) + "\n"


def adaptive_vs_fixed(args: dict) -> str:
    shifting = {**args, "lr": 1e-4}
    extra = ["parallel.ep=2", f"parallel.expert_probe_every={args['probe_every']}"]
    results = {name: measure("shifting", 2, shifting, [*extra, *flags], name) for name, flags in LAYOUTS.items()}
    first = results["alltoall/1"]["losses"]
    rows = [
        f"{args['shift_steps']} steps, routing skewed to rank 0's experts from step {args['shift_steps'] // 2}, ep=2\n",
        "| layout | tokens/s over the run | ratio to the best fixed layout | largest loss difference from alltoall/1 (relative) | layouts chosen (layout/chunks@step) |",
        "|---|---:|---:|---|---|",
    ]
    best = max(r["run_tokens_per_s"] for name, r in results.items() if not name.startswith("adaptive"))
    for name in (n for n in results if n.startswith("adaptive")):
        ROWS.append(
            ratio("mixture of experts", f"shifting routing, ep=2, {name}", "best fixed layout", "tokens/s", results[name]["run_tokens_per_s"], best)
        )
    for name, r in results.items():
        drift = max(abs(a - b) / abs(a) for a, b in zip(first, r["losses"]))
        rows.append(
            f"| {name} | {r['run_tokens_per_s']:.0f} | {r['run_tokens_per_s'] / best:.2f} | {drift:.1e} | {' '.join(r['chosen'] or []) or '-'} |"
        )
    return "\n".join(rows) + "\n"


OFFLOAD_LAYOUTS = (("ep=1", 1, "parallel.ep=1"), ("ep=2", 2, "parallel.ep=2"), ("tp=2", 2, "parallel.tp=2"))  # tp=2: expert widths split


def offload_vs_memory(args: dict) -> str:
    """The same MoE trained with its model states (experts included) streamed from disk and held in memory, at ep = 1,
    ep = 2 and tp = 2: step time, peak resident memory per rank, bytes moved to and from the disk tier per rank per step
    (the last step's)."""
    rows = [
        "| layout | states | step time (s) | step time ratio (disk / memory) | peak RSS per rank (MiB) | offload MiB read + written per rank per step |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, nproc, option in OFFLOAD_LAYOUTS:
        with tempfile.TemporaryDirectory(prefix="bench-moe-offload-") as run_dir:
            memory = measure("behemoth", nproc, args, [option, f"run.dir={run_dir}/m"], "in memory")
            disk = measure("behemoth", nproc, args, [option, f"run.dir={run_dir}/d", "offload.params=disk", "offload.optimizer=disk"], "offload disk")
        for r in (memory, disk):
            step_s = args["batch"] * args["seq"] / r["tokens_per_s"]
            ratio_cell = f"{memory['tokens_per_s'] / disk['tokens_per_s']:.2f}" if r is disk else ""
            rows.append(f"| {name} | {r['label']} | {step_s:.3f} | {ratio_cell} | {r['peak_rss_mib']:.0f} | {r['moved_mib']:.1f} |")
        ROWS.append(
            ratio(
                "mixture of experts",
                f"{' '.join(args['model'])}, {name}, offload disk",
                "in memory",
                "tokens/s",
                disk["tokens_per_s"],
                memory["tokens_per_s"],
            )
        )
    return "\n".join(rows) + "\n"


def write_readme(text: str, command: str) -> Path:
    """Replace this benchmark's section of benchmarks/README.md (other benchmarks' sections are left alone)."""
    path = ROOT / "benchmarks" / "README.md"
    body = f"{BEGIN}\nCommand: `{command}`\n\n{text}{END}"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in old:
        new = old[: old.index(BEGIN)] + body + old[old.index(END) + len(END) :]
    else:
        new = old.rstrip("\n") + "\n\n## Mixture of experts: behemoth vs DeepSpeed-MoE (`bench_moe.py`)\n\n" + body + "\n"
    path.write_text(new)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2 processes, a small model, few steps (a minute or two); prints only")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    p.add_argument("--parts", default="deepspeed,capacity,adaptive", help="comma-separated: deepspeed, capacity, adaptive, offload")
    p.add_argument("--no-write", action="store_true", help="print only; leave benchmarks/README.md alone")
    p.add_argument("--json", metavar="FILE", help="also write the ratio rows to FILE (for `behemoth bench`)")
    a = p.parse_args(argv)
    args = {**(QUICK if a.quick else FULL), "threads": a.threads, "lr": 1e-3}
    parts = a.parts.split(",")
    head = (
        f"float32, {' '.join(args['model'])}, batch {args['batch']} x {args['seq']} tokens per step, median of {args['steps']} steps "
        f"after {args['warmup']}, {a.threads} thread(s) per process\n\n"
    )
    text = head
    if "deepspeed" in parts:
        text += "### behemoth vs DeepSpeed-MoE (same weights, gating and capacity)\n\n" + versus_deepspeed(args) + "\n"
    if "capacity" in parts:
        text += "### Dropless vs capacity\n\n" + dropless_vs_capacity(args) + "\n"
    if "adaptive" in parts:
        text += "### Adaptive vs fixed expert layouts on a shifting routing\n\n" + adaptive_vs_fixed(args)
    if "offload" in parts:
        text += "### Model states (experts included) offloaded to disk vs in memory\n\n" + offload_vs_memory(args)
    print("\n" + text)
    write_rows(a.json, ROWS)
    if not (a.no_write or a.quick):
        print(f"wrote {write_readme(text, command_line('bench_moe.py', argv))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
