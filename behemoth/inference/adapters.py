"""Adapters out of a run and into weights: read a LoRA run's adapters from its checkpoint (saved under any layout),
write them in PEFT's layout, merge them into the base folder's weights (W + (alpha / r) B A, an HF folder again), or
add them to a model laid out for generation (each rank its part of every delta)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from behemoth.errors import BehemothError
from behemoth.faults.checkpoint import load_tensors
from behemoth.models.causal_lm import build_causal_lm
from behemoth.models.init import FULL_NAME, TAKE_LOCAL
from behemoth.models.lora import adapter_parameters, inject_lora
from behemoth.models.peft_io import Adapter, read_adapter, write_adapter


def adapter_tensors(ckpt: Path, cfg: Any) -> dict[str, torch.Tensor]:
    """A LoRA run's full adapter tensors from checkpoint `ckpt` (one process; the model is only built on meta)."""
    lm = build_causal_lm(cfg.model, cfg.hf)
    inject_lora(lm, cfg.finetune.lora)
    return load_tensors(ckpt, dict(adapter_parameters(lm.module)))


def run_adapter(ckpt: Path, cfg: Any) -> Adapter:
    lora = cfg.finetune.lora
    return Adapter(lora.rank, lora.alpha, lora.dropout, tuple(lora.targets), adapter_tensors(ckpt, cfg))


def save_run_adapter(ckpt: Path, cfg: Any, out: Path) -> Path:
    """The adapters of checkpoint `ckpt` as a PEFT folder (`peft.PeftModel.from_pretrained(base, out)` loads it)."""
    return write_adapter(out, adapter_tensors(ckpt, cfg), cfg.finetune.lora, cfg.hf.weights)


def merged(tensors: dict[str, torch.Tensor], adapter: Adapter) -> dict[str, torch.Tensor]:
    """Stored tensors with every adapted weight replaced by W + (alpha / r) B A (in float32, stored back in W's dtype)."""
    out = dict(tensors)
    for module in adapter.modules():
        key, delta = f"{module}.weight", adapter.delta(module)
        if key in tensors and delta is not None:
            w = tensors[key]
            out[key] = (w.float() + delta).to(w.dtype)
    return out


def export_merged(ckpt: Path, cfg: Any, out: Path) -> Path:
    """A LoRA run merged into its base folder's weights, as an HF folder (the base's config, tokenizer and shard layout),
    one safetensors shard in memory at a time."""
    from safetensors.torch import load_file, save_file

    base = Path(cfg.hf.weights or "")
    if not cfg.hf.weights or not base.is_dir():
        raise BehemothError(f"export --merge needs the run's base folder, but hf.weights={cfg.hf.weights!r} is not a folder", "restore it there")
    adapter = run_adapter(ckpt, cfg)
    out.mkdir(parents=True, exist_ok=True)
    done: set[str] = set()
    for f in sorted(base.iterdir()):
        if f.suffix == ".safetensors":
            tensors = load_file(str(f))
            done |= {m for m in adapter.modules() if f"{m}.weight" in tensors}
            save_file(merged(tensors, adapter), str(out / f.name), metadata={"format": "pt"})
        elif f.is_file():
            shutil.copy2(f, out / f.name)
    missing = sorted(set(adapter.modules()) - done)
    if missing:
        raise BehemothError(f"the base folder {base} has no weight for adapted module {missing[0]}", "export with the run's own base folder")
    return out


@torch.no_grad()
def apply_adapter(module: nn.Module, folder: str) -> int:
    """Add a PEFT LoRA folder's deltas to a laid-out model's weights (each rank its part: a tensor-parallel weight takes
    its slice of the full delta); the number of weights changed. Before quantization: the deltas are float."""
    adapter = read_adapter(folder)
    params = {getattr(p, FULL_NAME, n): p for n, p in module.named_parameters()}
    changed = 0
    for name in adapter.modules():
        p, delta = params.get(f"{name}.weight"), adapter.delta(name)
        if p is None or delta is None:
            continue  # another pipeline stage holds it (or the folder lacks its B)
        local = getattr(p, TAKE_LOCAL, lambda t: t)(delta)
        if tuple(local.shape) != tuple(p.shape):
            raise BehemothError(f"adapter {folder}: {name} has shape {tuple(delta.shape)}, the model's weight {tuple(p.shape)}", "use its base model")
        p.add_(local.to(p.device, p.dtype))
        changed += 1
    if not changed and adapter.modules():
        raise BehemothError(f"adapter {folder} adapts {adapter.modules()[0]}, which this model does not have", "use the adapter's base model")
    return changed
