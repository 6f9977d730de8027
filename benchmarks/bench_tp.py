"""behemoth tensor (and sequence) parallelism vs PyTorch DTensor `parallelize_module`, same plan, same model.

Both sides train behemoth's GPT on 2 processes (tp=2, float32) with the same initial weights, batches,
AdamW and clipping. The peer is the torchtitan recipe: ColwiseParallel / RowwiseParallel on the same
layers, SequenceParallel norms with PrepareModuleInput before attention and MLP (with SP), a
vocabulary-parallel embedding and LM head, and `loss_parallel` for the cross-entropy. DTensor splits
a weight into contiguous rows, so the peer's fused qkv rows are stored permuted ([q_r|k_r|v_r] per
rank): both sides then compute the same function, and the first losses are printed to show it. Run:

    python benchmarks/bench_tp.py [--steps 20] [--warmup 3] [--rounds 3] [--model gpt-6m]
    python benchmarks/bench_tp.py --compile        # both compiled: train.compile=true against DTensor's blocks compiled
    python benchmarks/bench_tp.py --part 2d [--steps 10]   # 2-D (SUMMA, 2 x 2 grid) vs 1-D tensor parallelism vs DTensor, 4 ranks
    python benchmarks/bench_tp.py --part 3d [--steps 10]   # 3-D (2 x 2 x 2 cube) vs 1-D tensor parallelism, 8 ranks
    python benchmarks/bench_tp.py --part subbatch [--model gpt-1m]   # sub-pipelined TP: tp_subbatches 1, 2, 4 at tp=2

The subbatch part also reports the seconds per step a rank waits on the blocks' all-reduces. At tp_subbatches=1 they
are synchronous, so the same schedule is run at S=1 (issue, then wait at once: nothing to hide them under) to time them;
the share hidden at S is 1 - waited(S) / waited(S=1 scheduled).

Each variant runs `--rounds` times, alternating behemoth and DTensor, and the best round of each is
reported. Prints a markdown table: tokens/s (median step), the ratio behemoth / DTensor, the CPU time a rank
spends per step (process time, which time-slicing by other programs does not inflate), and per rank the
model-state memory (parameters + gradients + Adam state, bytes counted) and the activation memory
(bytes autograd saves for backward in one forward, parameters excluded, each storage counted once), next to
the closed form of `behemoth/parallel/tensor/activations.py` (Korthikanti et al.'s accounting for this GPT)
and its value without parallelism. With `--compile` each side takes its compiled path (behemoth `train.compile=true`,
the peer each parallelized block compiled in place, torchtitan's order: parallelize, then compile), the compilation
falls in the untimed warm-up steps, and activation bytes are not measured (saved-tensor hooks around compiled graphs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from tp_peer import clip_mixed, dtensor_plan, permute_qkv_rows, split_optimizer

MODELS = {
    "gpt-1m": ["model=gpt-1m", "train.global_batch=16"],
    "gpt-6m": ["model=gpt-1m", "model.n_layer=6", "model.d_model=256", "model.n_head=8", "model.context=256", "train.global_batch=8"],
}


def predicted_activation_mb(cfg_dict: dict[str, Any], t: int, sp: bool) -> float:
    """MiB the closed form says one rank saves in the step's forward (one micro-batch of the global batch)."""
    from behemoth.config import Config
    from behemoth.models.activations import gpt_activation_bytes

    cfg = Config.model_validate(cfg_dict)
    return gpt_activation_bytes(cfg.model, b=cfg.train.global_batch, s=cfg.seq_len, t=t, sp=sp) / 2**20


def make_config(model: str, sp: bool, compiled: bool = False) -> dict[str, Any]:
    from behemoth.config import load_config

    extra = ["parallel.tp=2", f"parallel.sequence_parallel={str(sp).lower()}", "run.progress=false", f"train.compile={str(compiled).lower()}"]
    return load_config(None, MODELS[model] + extra).model_dump(mode="json")


def saved_activation_bytes(forward_loss, params: list) -> tuple[Any, int]:
    """Run `forward_loss()`; bytes of the distinct storages autograd saves for backward, parameters excluded."""
    import torch
    from torch.distributed.tensor import DTensor

    local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
    skip = {local(p).untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        s = local(t).untyped_storage()
        if s.data_ptr() not in skip and s.device.type != "meta":
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward_loss()
    return loss, sum(seen.values())


def state_bytes(params: list, optimizer: Any) -> int:
    """Parameters + gradients + optimizer state this rank holds (local parts of DTensors)."""
    import torch
    from torch.distributed.tensor import DTensor

    local = lambda t: t._local_tensor if isinstance(t, DTensor) else t  # noqa: E731
    size = lambda t: local(t).numel() * local(t).element_size()  # noqa: E731
    total = sum(size(p) + (size(p.grad) if p.grad is not None else 0) for p in params)
    return total + sum(size(t) for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0)


def bench_rank(kind: str, cfg_dict: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    """One rank of `behemoth` (Engine.train_step) or `dtensor` (parallelize_module)."""
    import torch.distributed as dist

    from behemoth.config import Config
    from behemoth.data import BatchLayout, BatchSampler, prepare_corpus
    from behemoth.engine import lr_at
    from behemoth.topology import init_runtime

    cfg = Config.model_validate(cfg_dict)
    rt = init_runtime(**cfg.parallel.degrees())
    corpus = prepare_corpus(cfg.data.path, cfg.data.val_fraction, cfg.data.cache_dir)
    sampler = BatchSampler(corpus.train, cfg.seq_len, BatchLayout.resolve(cfg.train.global_batch, None, 1), 0, cfg.train.seed)
    runner = BehemothRunner(cfg, rt, scheduled=kind == "scheduled") if kind != "dtensor" else DTensorRunner(cfg, rt)
    times, cpu, losses, act = [], [], [], 0
    for step in range(warmup + steps):
        batches = sampler.micro_batches(step)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss, measured = runner.step(batches, lr_at(step, cfg.train), measure=step == 0 and not cfg.train.compile)  # step 0 counts bytes
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(loss)
        act = measured or act
        if step + 1 == max(1, warmup):
            waited0 = runner.waited_s()
    median = statistics.median(times[max(1, warmup) :])
    return {
        "tokens_per_s": cfg.train.global_batch * cfg.seq_len / median,
        "losses": losses[:3],
        "cpu_s": statistics.median(cpu[max(1, warmup) :]),
        "activation_mb": act / 2**20,
        "state_mb": runner.state_bytes() / 2**20,
        "param_mb": runner.param_bytes() / 2**20,
        "waited_s": (runner.waited_s() - waited0) / (warmup + steps - max(1, warmup)),
    }


class BehemothRunner:
    """behemoth's engine; activation bytes measured on the step's forward."""

    def __init__(self, cfg: Any, rt: Any, scheduled: bool = False) -> None:
        from behemoth.engine import build_engine
        from behemoth.parallel.tensor.subbatch import SubBatchSchedule, apply_subbatches

        self.engine = build_engine(cfg, rt)
        module = self.engine.model.module
        blocks = module.get_submodule(self.engine.model.lm.layers.blocks)
        if scheduled:  # tp_subbatches=1 run by the sub-batch schedule, to time its (then exposed) all-reduces
            apply_subbatches(blocks, next(iter(blocks.children())).attn.proj.tp, 1)
        self.schedules = [b.forward.__self__ for b in blocks.children() if isinstance(getattr(b.forward, "__self__", None), SubBatchSchedule)]

    def waited_s(self) -> float:
        """Seconds this rank has waited on the sub-batch schedules' all-reduces (0 without them)."""
        return sum(sum(s.waited_s.values()) for s in self.schedules)

    def step(self, batches: list, lr: float, measure: bool) -> tuple[float, int]:
        """One training step; when measuring, the bytes autograd saves in its forward and loss (one micro-batch: each
        backward runs inside the measured call too, but saves nothing)."""
        if not measure:
            return self.engine.train_step(batches, lr).loss, 0
        params = list(self.engine.model.module.parameters())
        original, measured = self.engine.forward_backward, {}

        def forward_backward(micro_batches):
            loss, measured["bytes"] = saved_activation_bytes(lambda: original(micro_batches), params)
            return loss

        self.engine.forward_backward = forward_backward
        result = self.engine.train_step(batches, lr)
        self.engine.forward_backward = original
        return result.loss, measured["bytes"]

    def state_bytes(self) -> int:
        return sum(self.engine.model_state_bytes().values())

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.engine.model.module.parameters())


class DTensorRunner:
    """behemoth's GPT (same init) under torch's parallelize_module and loss_parallel, written as torchtitan does."""

    def waited_s(self) -> float:
        return 0.0

    def __init__(self, cfg: Any, rt: Any) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        from behemoth.models.gpt import build_gpt
        from behemoth.models.init import materialize

        self.cfg, self.tp_group = cfg, rt.group("tp")
        model = build_gpt(cfg.model)
        materialize(model, seed=cfg.train.seed, device=rt.device, init_spec=model.init_spec)
        permute_qkv_rows(model, rt.dims.tp)
        self.model = parallelize_module(model, rt.mesh["tp"], dtensor_plan(model, cfg.parallel.sequence_parallel))
        for block in model.blocks if cfg.train.compile else ():
            block.compile()  # the peer's compiled path: each parallelized block, in place
        self.optimizer = split_optimizer(self.model, cfg.train)

    def step(self, batches: list, lr: float, measure: bool) -> tuple[float, int]:
        import torch.nn.functional as F
        from torch.distributed.tensor.parallel import loss_parallel

        params = list(self.model.parameters())
        self.optimizer.zero_grad(set_to_none=True)
        total, act = 0.0, 0
        tokens = self.cfg.train.global_batch * self.cfg.seq_len
        for x, y in batches:
            with loss_parallel():
                forward = lambda: F.cross_entropy(self.model(x).flatten(0, 1), y.flatten(), reduction="sum") / tokens  # noqa: E731
                loss, act = saved_activation_bytes(forward, params) if measure else (forward(), 0)
                loss.backward()
            total += float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach())
        clip_mixed(params, self.cfg.train.grad_clip, self.tp_group)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        return total, act

    def state_bytes(self) -> int:
        return state_bytes(list(self.model.parameters()), self.optimizer)

    def param_bytes(self) -> int:
        local = lambda t: getattr(t, "_local_tensor", t)  # noqa: E731
        return sum(local(p).numel() * local(p).element_size() for p in self.model.parameters())


def run(model: str, steps: int, warmup: int, rounds: int, compiled: bool = False) -> list[dict[str, Any]]:
    """Each variant `rounds` times, alternating behemoth and DTensor; the best round of each is kept
    (on a shared machine, interference only ever slows a run down)."""
    from behemoth.faults.ranks import run_ranks

    rows = []
    for sp in (False, True):
        cfg = make_config(model, sp, compiled)
        best: dict[str, list[dict[str, Any]]] = {}
        for _ in range(rounds):
            for kind in ("behemoth", "dtensor"):
                res = run_ranks(2, bench_rank, kind, cfg, steps, warmup, timeout=3600)
                if kind not in best or res[0]["tokens_per_s"] > best[kind][0]["tokens_per_s"]:
                    best[kind] = res
        rows.append(
            {
                "model": model,
                "sp": sp,
                "ours": best["behemoth"],
                "peer": best["dtensor"],
                "formula_mb": predicted_activation_mb(cfg, 2, sp),
                "t1_mb": predicted_activation_mb(cfg, 1, False),
            }
        )
    return rows


# (tp, name, overrides) on tp ranks, 1-D first; "dtensor": torch's parallelize_module (1-D, the same plan as behemoth's)
VARIANTS = {
    "2d": ((4, "1d", ()), (4, "2d", ()), (4, "dtensor", ("parallel.tp_mode=1d",))),
    "3d": ((8, "1d", ()), (8, "3d", ()), (8, "3d-regather", ("parallel.tp_mode=3d", "parallel.tp_regather=true"))),
}


def run_2d(model: str, steps: int, warmup: int, rounds: int, part: str = "2d") -> dict[str, Any]:
    """behemoth at tp=4 on 4 ranks, 1-D (Megatron, no SP) and 2-D (SUMMA on a 2 x 2 grid), and DTensor's 1-D, or (`part`
    3d) at tp=8 on 8 ranks, 1-D and 3-D (a 2 x 2 x 2 cube), alternating; best round each."""
    from behemoth.config import load_config
    from behemoth.faults.ranks import run_ranks

    best: dict[str, list[dict[str, Any]]] = {}
    for _ in range(rounds):
        for tp, mode, extra in VARIANTS[part]:
            overrides = [f"parallel.tp={tp}", *(extra or [f"parallel.tp_mode={mode}"]), "run.progress=false"]
            cfg = load_config(None, MODELS[model] + overrides).model_dump(mode="json")
            res = run_ranks(tp, bench_rank, "dtensor" if mode == "dtensor" else "behemoth", cfg, steps, warmup, timeout=3600)
            if mode not in best or res[0]["tokens_per_s"] > best[mode][0]["tokens_per_s"]:
                best[mode] = res
    return {"model": model, "part": part, **best}


def run_subbatch(model: str, steps: int, warmup: int, rounds: int) -> dict[str, Any]:
    """behemoth at tp=2 on 2 ranks with tp_subbatches 1, 2, 4 (and 1 through the schedule, to time the all-reduces),
    alternating; the best round of each."""
    from behemoth.config import load_config
    from behemoth.faults.ranks import run_ranks

    best: dict[str, list[dict[str, Any]]] = {}
    variants = (("1", "behemoth", 1), ("1 (scheduled)", "scheduled", 1), ("2", "behemoth", 2), ("4", "behemoth", 4))
    for _ in range(rounds):
        for name, kind, s in variants:
            extra = ["parallel.tp=2", f"parallel.tp_subbatches={s}", "run.progress=false"]
            cfg = load_config(None, MODELS[model] + extra).model_dump(mode="json")
            res = run_ranks(2, bench_rank, kind, cfg, steps, warmup, timeout=3600)
            if name not in best or res[0]["tokens_per_s"] > best[name][0]["tokens_per_s"]:
                best[name] = res
    return {"model": model, **best}


def print_subbatch_table(row: dict[str, Any]) -> None:
    worst = lambda name, key: max(x[key] for x in row[name])  # noqa: E731  (the slowest rank)
    exposed = worst("1 (scheduled)", "waited_s")
    print("| model | tp | tp_subbatches | tok/s | vs S=1 | step ms | CPU s/step/rank | all-reduce wait ms/step | share hidden | first losses |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = row["1"][0]["tokens_per_s"]
    for name in ("1", "1 (scheduled)", "2", "4"):
        r = row[name][0]
        waited = worst(name, "waited_s")
        hidden = "" if name == "1" else f"{1 - waited / exposed:.2f}" if exposed else "-"
        wait_ms = "(synchronous)" if name == "1" else f"{1e3 * waited:.1f}"
        losses = ", ".join(f"{x:.4f}" for x in r["losses"][:3:2])
        step_ms = 1e3 * row["model_tokens"] / r["tokens_per_s"] if "model_tokens" in row else 0.0
        print(
            f"| {row['model']} | 2 | {name} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.3f} | {step_ms:.0f} "
            f"| {worst(name, 'cpu_s'):.3f} | {wait_ms} | {hidden} | {losses} |",
            flush=True,
        )


def print_2d_table(row: dict[str, Any]) -> None:
    worst = lambda mode, key: max(x[key] for x in row[mode])  # noqa: E731  (the rank that holds most, or is slowest)
    print("| model | tp | mode | tok/s | CPU s/step/rank | parameters MiB/rank | activations MiB/rank | model states MiB/rank | first losses |")
    print("|---|---|---|---|---|---|---|---|---|")
    variants = VARIANTS[row.get("part", "2d")]
    for tp, mode, _ in variants:
        r = row[mode][0]
        losses = ", ".join(f"{x:.4f}" for x in r["losses"][:3:2])
        print(
            f"| {row['model']} | {tp} | {mode} | {r['tokens_per_s']:.0f} | {worst(mode, 'cpu_s'):.3f} | {worst(mode, 'param_mb'):.2f} "
            f"| {worst(mode, 'activation_mb'):.1f} | {worst(mode, 'state_mb'):.1f} | {losses} |"
        )
    print()
    for _, mode, _ in variants[1:]:
        ratio = lambda key: worst(mode, key) / worst("1d", key)  # noqa: E731, B023
        print(
            f"{mode.upper()} / 1D: tokens/s {row[mode][0]['tokens_per_s'] / row['1d'][0]['tokens_per_s']:.3f}, CPU s/step {ratio('cpu_s'):.3f}, "
            f"parameters {ratio('param_mb'):.3f}, activations {ratio('activation_mb'):.3f}",
            flush=True,
        )


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "| model | tp | SP | behemoth tok/s | DTensor tok/s | ratio | CPU s/step/rank behemoth / DTensor "
        "| activations MiB/rank behemoth / DTensor | formula (t=1) | model states MiB/rank behemoth / DTensor "
        "| first losses (behemoth / DTensor) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        a, b = r["ours"][0], r["peer"][0]
        act = lambda res: max(x["activation_mb"] for x in res)  # noqa: E731
        st = lambda res: max(x["state_mb"] for x in res)  # noqa: E731
        pair = lambda res: ", ".join(f"{x:.4f}" for x in res["losses"][:3:2])  # noqa: E731  (first and third step)
        losses = f"{pair(a)} / {pair(b)}"
        cpu = lambda res: max(x["cpu_s"] for x in res)  # noqa: E731
        print(
            f"| {r['model']} | 2 | {'yes' if r['sp'] else 'no'} | {a['tokens_per_s']:.0f} | {b['tokens_per_s']:.0f} "
            f"| {a['tokens_per_s'] / b['tokens_per_s']:.3f} | {cpu(r['ours']):.3f} / {cpu(r['peer']):.3f} "
            f"| {act(r['ours']):.1f} / {act(r['peer']):.1f} | {r['formula_mb']:.1f} ({r['t1_mb']:.1f}) "
            f"| {st(r['ours']):.1f} / {st(r['peer']):.1f} | {losses} |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each variant, alternating; the best is reported")
    parser.add_argument("--model", default="gpt-6m", choices=sorted(MODELS))
    parser.add_argument(
        "--part",
        default="dtensor",
        choices=("dtensor", "2d", "3d", "subbatch"),
        help="vs DTensor at tp=2, 2-D vs 1-D TP at tp=4, 3-D vs 1-D at tp=8, or sub-pipelined TP (tp_subbatches 1, 2, 4) at tp=2",
    )
    parser.add_argument("--compile", action="store_true", help="--part dtensor with both sides compiled")
    from ratios import add_report_args, write_rows

    add_report_args(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds = 3, 1, 1
    if args.part == "subbatch":
        row = run_subbatch(args.model, args.steps, args.warmup, args.rounds)
        print_subbatch_table({**row, "model_tokens": model_tokens(args.model)})
        return 0
    if args.part in VARIANTS:
        print_2d_table(run_2d(args.model, args.steps, args.warmup, args.rounds, args.part))
        return 0
    rows = run(args.model, args.steps, args.warmup, args.rounds, args.compile)
    print_table(rows)
    write_rows(args.json, ratio_rows(rows))
    return 0


def model_tokens(model: str) -> int:
    """Tokens in one step of the benchmark's model (global batch x sequence)."""
    from behemoth.config import Config, load_config

    cfg = Config.model_validate(load_config(None, MODELS[model]).model_dump(mode="json"))
    return cfg.train.global_batch * cfg.seq_len


def ratio_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table's comparisons as `behemoth bench` rows: throughput, CPU time and activation memory vs DTensor."""
    from ratios import ratio

    out = []
    for r in rows:
        case, a, b = f"{r['model']}, tp=2{' + SP' if r['sp'] else ''}", r["ours"], r["peer"]
        out += [
            ratio("tensor parallel", case, "DTensor", "tokens/s", a[0]["tokens_per_s"], b[0]["tokens_per_s"]),
            ratio(
                "tensor parallel", case, "DTensor", "CPU s per step", max(x["cpu_s"] for x in a), max(x["cpu_s"] for x in b), higher_is_better=False
            ),
        ]
        if max(x["activation_mb"] for x in b) > 0:  # not measured with --compile
            act = [max(x["activation_mb"] for x in side) for side in (a, b)]
            out.append(ratio("tensor parallel", case, "DTensor", "activations per rank", *act, higher_is_better=False))
    return out


if __name__ == "__main__":
    sys.exit(main())
