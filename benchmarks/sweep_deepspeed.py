"""`bench_sweep.py --cases deepspeed`: the sweep's K trials trained one after another by DeepSpeed, as a peer.

    python -m torch.distributed.run --standalone --nproc-per-node N benchmarks/sweep_deepspeed.py \
        --config base.yaml --lrs 0.003,0.0045 --stage 1 --out result.json

One torchrun launch trains every trial in turn (as a sequential sweep reuses one slot process): behemoth's model of the
trial's config built and initialized as `behemoth train` does (layout-independent: seed and parameter name), the same
token batches (behemoth's sampler, each rank its data-parallel rows), the same learning-rate schedule (`lr_at`, set
on DeepSpeed's optimizer before each step), torch's AdamW with behemoth's weight-decay rule and kernel, global-norm
clipping by DeepSpeed, and ZeRO `--stage` over the gloo ranks on DeepSpeed's CPU accelerator. Rank 0 writes each
trial's per-step losses, final validation loss and wall seconds, and the launch's CPU seconds of every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def trial_engine(cfg: Any, stage: int, world: int) -> tuple[Any, Any]:
    """DeepSpeed's engine over behemoth's model of `cfg` (fp32, ZeRO `stage`), and the batch layout it trains with."""
    import deepspeed
    import torch

    from behemoth.data.sampling import BatchLayout
    from behemoth.models.causal_lm import build_causal_lm
    from behemoth.models.init import materialize
    from behemoth.parallel.sync import adamw_settings, decays

    cpu = torch.device("cpu")
    lm = build_causal_lm(cfg.model, cfg.hf)
    materialize(lm.module, seed=cfg.train.seed, device=cpu, init_spec=lm.init_spec)
    lm.after_materialize(cpu)
    settings = adamw_settings(cfg.train, cpu)
    params = list(lm.module.parameters())
    groups = [
        {"params": [p for p in params if decays(p.shape)], "weight_decay": settings.weight_decay},
        {"params": [p for p in params if not decays(p.shape)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=settings.lr, betas=settings.betas, **settings.kernel_flags())
    layout = BatchLayout.resolve(cfg.train.global_batch, None, world)
    config = {
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.accum,
        "gradient_clipping": cfg.train.grad_clip,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=lm.module, optimizer=opt, config=config)
    return engine, layout


def global_sum(*values: float) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def train_trial(cfg: Any, stage: int) -> dict[str, Any]:
    """One trial to `train.steps` steps: its per-step global mean losses and its final validation loss."""
    import torch
    import torch.distributed as dist

    from behemoth.data import BatchSampler
    from behemoth.engine import lr_at
    from behemoth.models.causal_lm import summed_token_loss
    from behemoth.train import TRAIN_STREAM, VAL_STREAM

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, layout = trial_engine(cfg, stage, world)
    corpus = cfg.prepare_corpus(progress=False)
    train = BatchSampler(cfg.corpus_split(corpus, "train"), cfg.seq_len, layout, rank, cfg.train.seed, TRAIN_STREAM)
    val = BatchSampler(cfg.corpus_split(corpus, "val"), cfg.seq_len, layout, rank, cfg.train.seed, VAL_STREAM)
    losses = []
    for step in range(cfg.train.steps):
        for group in engine.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg.train)
        summed, count = 0.0, 0
        for x, y in train.micro_batches(step):  # DeepSpeed divides by the accumulation steps and averages over ranks
            loss_sum = summed_token_loss(engine(x), y)
            engine.backward(loss_sum / y.numel())
            engine.step()
            summed, count = summed + float(loss_sum.detach()), count + y.numel()
        total, tokens = global_sum(summed, float(count))
        losses.append(total / tokens)
    engine.eval()
    with torch.no_grad():
        stats = [(float(summed_token_loss(engine(x), y)), float(y.numel())) for i in range(cfg.train.eval_batches) for x, y in val.micro_batches(i)]
    total, count = global_sum(sum(s for s, _ in stats), sum(n for _, n in stats))
    engine.destroy()
    return {"losses": losses, "val_loss": total / count}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="the sweep's base config (YAML)")
    p.add_argument("--lrs", required=True, help="the trials' train.lr values, comma-separated")
    p.add_argument("--stage", type=int, default=0, choices=[0, 1, 2, 3])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    from behemoth.config import load_config

    deepspeed.init_distributed(dist_backend="gloo")
    trials = []
    for lr in args.lrs.split(","):
        t0 = time.perf_counter()
        result = train_trial(load_config(args.config, [f"train.lr={lr}"]), args.stage)
        trials.append({"lr": float(lr), **result, "wall_s": time.perf_counter() - t0})
    usage = resource.getrusage(resource.RUSAGE_SELF)
    (cpu,) = global_sum(usage.ru_utime + usage.ru_stime)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"trials": trials, "ranks_cpu_s": cpu, "world": dist.get_world_size(), "stage": args.stage}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
