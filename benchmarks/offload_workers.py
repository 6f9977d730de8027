"""The workers of bench_offload.py: each runs in a fresh process (`bench_offload.py --worker KIND SPEC`) and prints one
RESULT line: plain PyTorch in memory, behemoth with disk offload, DeepSpeed ZeRO-Offload / ZeRO-Infinity."""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path
from typing import Any

RESULT = "RESULT "


def status_kb(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+)", Path("/proc/self/status").read_text(), re.M).group(1))


def gpt(n_layer: int, d: int, heads: int, seq: int) -> dict[str, Any]:
    return {"preset": "gpt-tiny", "n_layer": n_layer, "d_model": d, "n_head": heads, "context": seq, "vocab_size": 256}


def batch(seq: int, m: int = 1) -> list[tuple[Any, Any]]:
    import torch

    tokens = torch.randint(0, 256, (m, seq + 1), generator=torch.Generator().manual_seed(0))
    return [(tokens[i : i + 1, :-1], tokens[i : i + 1, 1:]) for i in range(m)]


def plain_worker(spec: dict) -> dict:
    """Plain PyTorch: the GPT materialized in memory, float32 AdamW, one step."""
    import torch
    import torch.nn.functional as F

    from behemoth.models.gpt import GPTConfig, build_gpt
    from behemoth.models.init import materialize
    from benchmarks.peers import plain_adamw

    cfg = GPTConfig.model_validate(gpt(spec["n_layer"], spec["d"], spec["heads"], spec["seq"]))
    model = build_gpt(cfg)
    materialize(model, seed=0, device=torch.device("cpu"), init_spec=model.init_spec)
    opt = plain_adamw(model, argparse.Namespace(lr=1e-4, beta1=0.9, beta2=0.95, weight_decay=0.1))
    x, y = batch(spec["seq"])[0]
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    return {"params": cfg.num_params(), "loss": float(loss), "peak_rss_gib": status_kb("VmHWM") / 2**20}


def offload_worker(spec: dict) -> dict:
    """behemoth: parameters and optimizer state on disk, streamed; two steps on one fixed sequence, then an evaluation."""
    import torch

    from behemoth.config import Config
    from behemoth.engine import build_engine
    from behemoth.offload.calibrate import calibrate
    from behemoth.topology import init_runtime

    m = spec.get("m", 1)
    cfg = Config.model_validate(
        {
            "model": gpt(spec["n_layer"], spec["d"], spec["heads"], spec["seq"]),
            "train": {"global_batch": m, "micro_batch": 1, "grad_clip": spec.get("grad_clip", 0.0), "lr": spec.get("lr", 1e-4)},
            "offload": {
                "params": "disk",
                "optimizer": "disk",
                "grads": spec.get("grads", "device"),
                "dir": spec["dir"],
                "optimizer_bits": spec["bits"],
                "order": spec.get("order", "harmony"),
                "max_memory_gb": spec.get("budget_gb"),
            },
            "run": {"dir": spec["dir"] + "-run", "timeout_s": 3600},
        }
    )
    rates = (
        calibrate(
            Path(spec["dir"]), torch.device("cpu"), disk_bytes=spec["calibration_mb"] * 2**20, matmul=(spec["seq"] * m, spec["d"], 4 * spec["d"])
        )
        if spec.get("calibrate")
        else None
    )
    rt = init_runtime(timeout_s=3600)
    Path("/proc/self/clear_refs").write_text("5")
    base = status_kb("VmRSS")
    t0 = time.perf_counter()
    engine = build_engine(cfg, rt)
    init_s = time.perf_counter() - t0
    sync = engine.model.syncs[0]  # the offload runtime: the one sync of an offloaded model
    steps = []
    for _ in range(spec.get("steps", 2)):
        t0 = time.perf_counter()
        r = engine.train_step(batch(spec["seq"], m), lr=spec.get("lr", 1e-4))
        steps.append({"loss": r.loss, "seconds": time.perf_counter() - t0, "bytes": sync.step_bytes(), "io_wait_s": r.metrics["offload_io_wait_s"]})
    after = engine.evaluate(batch(spec["seq"], 1)) if spec.get("evaluate", True) else None
    flops = engine.model.lm.flops_per_token(spec["seq"]) * spec["seq"] * m * 4 / 3
    out = {
        "params": cfg.model.num_params(),
        "init_s": init_s,
        "steps": steps,
        "loss_after": after,
        "flops": flops,
        "peak_rss_gib": status_kb("VmHWM") / 2**20,
        "rss_growth_gib": (status_kb("VmHWM") - base) / 2**20,
        "prefetch": sync.prefetch,
        "rates": None if rates is None else vars(rates),
    }
    engine.close()
    rt.close()
    return out


def deepspeed_worker(spec: dict) -> dict:
    """DeepSpeed ZeRO-3 on its CPU accelerator with the optimizer (and, for NVMe, the parameters) offloaded."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.nn.functional as F

    from behemoth.models.gpt import GPTConfig, build_gpt
    from behemoth.models.init import materialize

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = GPTConfig.model_validate(gpt(spec["n_layer"], spec["d"], spec["heads"], spec["seq"]))
    model = build_gpt(cfg)
    materialize(model, seed=0, device=torch.device("cpu"), init_spec=model.init_spec)
    where = {"device": spec["device"]} if spec["device"] == "cpu" else {"device": "nvme", "nvme_path": spec["dir"]}
    zero = {"stage": 3, "offload_optimizer": where, **({"offload_param": where} if spec["device"] == "nvme" else {})}
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "steps_per_print": 10**9,
    }
    if spec["device"] == "nvme":
        config["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x, y = batch(spec["seq"])[0]
    times, losses = [], []
    for _ in range(spec.get("steps", 2)):
        t0 = time.perf_counter()
        loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return {"params": cfg.num_params(), "seconds": times, "losses": losses, "peak_rss_gib": status_kb("VmHWM") / 2**20}


WORKERS = {"plain": plain_worker, "offload": offload_worker, "deepspeed": deepspeed_worker}


def worker_main(kind: str, spec_json: str) -> int:
    out = WORKERS[kind](json.loads(spec_json))
    print(RESULT + json.dumps(out), flush=True)
    return 0
