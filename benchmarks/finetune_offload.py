"""`bench_finetune.py --part offload`: LoRA on a frozen Llama-shaped base larger than this machine's memory, streamed from disk.

The base (random float32 weights, Llama-7B widths: hidden 4096, MLP 11008, 32 heads, 8 KV heads; as many layers as
`--gb` asks) is written shard by shard (one safetensors file per layer, never whole in memory) into a temporary
folder, after checking the free disk. behemoth then trains LoRA adapters on it in a fresh process with
`offload.params=disk` (each unit read straight from the folder, nothing written) and `offload.max_memory_gb`, on one
fixed batch, so the loss must fall. Reported: the median step time, the I/O bound (bytes the step read over the
folder's sequential read rate, measured first with the same plain reads on files the page cache no longer holds),
their ratio, the process's peak resident set (VmHWM) against the budget, and the losses. The folder is removed at the end.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GB, GiB = 10**9, 2**30
WIDTHS = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)


def layer_numel(w: dict[str, int]) -> int:
    h, f, kv = w["hidden_size"], w["intermediate_size"], w["hidden_size"] * w["num_key_value_heads"] // w["num_attention_heads"]
    return 2 * h * h + 2 * h * kv + 3 * h * f + 2 * h


def layers_for(gb: float, w: dict[str, int]) -> int:
    """Layers that make the float32 base at least `gb` GB (embedding and head included)."""
    rest = 2 * w["vocab_size"] * w["hidden_size"] + w["hidden_size"]
    return max(1, math.ceil((gb * GB / 4 - rest) / layer_numel(w)))


def layer_tensors(i: int, w: dict[str, int], gen: Any) -> dict[str, Any]:
    import torch

    h, f, kv = w["hidden_size"], w["intermediate_size"], w["hidden_size"] * w["num_key_value_heads"] // w["num_attention_heads"]
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, h)}
    shapes |= {"mlp.gate_proj": (f, h), "mlp.up_proj": (f, h), "mlp.down_proj": (h, f)}
    out = {f"model.layers.{i}.{k}.weight": torch.empty(s).normal_(0, 0.02, generator=gen) for k, s in shapes.items()}
    out |= {f"model.layers.{i}.{n}.weight": torch.ones(h) for n in ("input_layernorm", "post_attention_layernorm")}
    return out


def write_base(folder: Path, n_layer: int, w: dict[str, int], seq: int) -> float:
    """config.json and one safetensors file per layer (plus one for embedding and head); seconds taken."""
    import torch
    import transformers
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    folder.mkdir(parents=True)
    transformers.LlamaConfig(**w, num_hidden_layers=n_layer, max_position_embeddings=seq).save_pretrained(str(folder))
    gen = torch.Generator().manual_seed(0)
    h, v = w["hidden_size"], w["vocab_size"]
    ends = {"model.embed_tokens.weight": torch.empty(v, h).normal_(0, 0.02, generator=gen), "model.norm.weight": torch.ones(h)}
    ends["lm_head.weight"] = torch.empty(v, h).normal_(0, 0.02, generator=gen)
    save_file(ends, str(folder / "model-ends.safetensors"))
    for i in range(n_layer):
        save_file(layer_tensors(i, w, gen), str(folder / f"model-{i:05d}.safetensors"))
    return time.perf_counter() - t0


def read_rate(files: list[Path], limit: int) -> float:
    """Bytes per second of plain sequential reads of the files (up to `limit` bytes), 64 MiB at a time."""
    buf = bytearray(64 * 2**20)
    done, t0 = 0, time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while (n := f.readinto(buf)) and done < limit:
                done += n
        if done >= limit:
            break
    return done / (time.perf_counter() - t0)


def vm_kb(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+)", Path("/proc/self/status").read_text(), re.M).group(1))


def offload_worker(folder: str, work: str, steps: int, seq: int, budget_gb: float, rank: int) -> dict[str, Any]:
    """In this process: LoRA on the streamed base, one fixed batch for every step; times, losses, bytes read, peak RSS."""
    import torch

    from behemoth.config import load_config
    from behemoth.engine import build_engine
    from behemoth.topology import init_runtime

    options = [f"hf.weights={folder}", "finetune.lora.enabled=true", f"finetune.lora.rank={rank}", f"finetune.lora.alpha={2 * rank}"]
    options += ["offload.params=disk", f"offload.dir={work}/scratch", f"offload.max_memory_gb={budget_gb}", f"run.dir={work}/run"]
    cfg = load_config(None, [*options, "train.global_batch=1", f"train.seq_len={seq}", "train.lr=1e-3", "train.grad_clip=1.0"])
    start = vm_kb("VmRSS")
    engine = build_engine(cfg, init_runtime())
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.model.vocab_size, (1, seq), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (1, seq), generator=g)
    times, losses, read, waited = [], [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        result = engine.train_step([(x, y)], 1e-3)
        times.append(time.perf_counter() - t0)
        losses.append(result.loss)
        read.append(sum(v for k, v in result.metrics.items() if k.startswith("offload_read_mb_")) * 2**20)
        waited.append(result.metrics.get("offload_io_wait_s", 0.0))
    engine.close()
    return {"times": times, "losses": losses, "read": read, "waited": waited, "peak_kb": vm_kb("VmHWM"), "start_kb": start}


def bench_offload(args: Any) -> list[dict[str, Any]]:
    """Write the base (if the disk allows), measure the read rate, train in a fresh process, print the table."""
    from ratios import ratio

    n_layer = layers_for(args.gb, WIDTHS)
    size = 4 * (n_layer * layer_numel(WIDTHS) + 2 * WIDTHS["vocab_size"] * WIDTHS["hidden_size"] + WIDTHS["hidden_size"])
    root = (Path(args.dir) if args.dir else Path(tempfile.gettempdir()) / f"behemoth-offload-base-{os.getpid()}").resolve()
    root.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root.parent).free
    print(f"base: {n_layer} layers of Llama-7B widths, {size / GB:.1f} GB float32 ({size / GiB:.1f} GiB); free disk {free / GB:.1f} GB")
    if free < size + 5 * GB:
        print(f"not run: the base needs {size / GB:.1f} GB plus 5 GB to spare on {root.parent}; lower --gb or free the disk")
        return []
    try:
        wrote = write_base(root / "base", n_layer, WIDTHS, args.seq)
        files = sorted((root / "base").glob("model-0*.safetensors"))
        rate = read_rate(files, 4 * GiB)  # the first layers: written long ago, out of the page cache by now
        print(f"wrote the base in {wrote:.0f} s; sequential read rate {rate / GB:.2f} GB/s\n")
        code = (
            "import json, sys; sys.path.insert(0, 'benchmarks'); from finetune_offload import offload_worker; "
            f"print(json.dumps(offload_worker({str(root / 'base')!r}, {str(root)!r}, {args.steps}, {args.seq}, {args.max_memory_gb}, {args.rank})))"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
        if out.returncode:
            print(out.stderr[-3000:])
            return []
        run = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return report(run, rate, size, args, ratio)


def report(run: dict[str, Any], rate: float, size: int, args: Any, ratio: Any) -> list[dict[str, Any]]:
    """The table: step time vs the I/O bound, peak memory vs the budget, the losses."""
    later = slice(1, None) if len(run["times"]) > 1 else slice(None)
    step = statistics.median(run["times"][later])
    read = statistics.median(run["read"][later])
    bound = read / rate
    peak_gib = run["peak_kb"] * 1024 / GiB
    waited = statistics.median(run["waited"][later])
    print("| base on disk | step (median) | read per step | I/O bound | step / bound | compute waited for I/O | peak RSS | budget | losses |")
    print("|---|---|---|---|---|---|---|---|---|")
    losses = ", ".join(f"{x:.4f}" for x in run["losses"])
    print(
        f"| {size / GB:.1f} GB | {step:.1f} s | {read / GB:.1f} GB | {bound:.1f} s | {step / bound:.2f}x | {waited:.1f} s | {peak_gib:.2f} GiB "
        f"| {args.max_memory_gb} GiB | {losses} |"
    )
    print(f"\nstep times: {', '.join(f'{t:.1f}' for t in run['times'])} s; loss fell: {run['losses'][-1] < run['losses'][0]}")
    case = f"LoRA r{args.rank}, {size / GB:.0f} GB float32 base streamed from disk, seq {args.seq}"
    return [ratio("finetune", case, "I/O bound", "step s", step, bound, higher_is_better=False)]
