"""LoRA adapters in PEFT's layout: `adapter_config.json` + `adapter_model.safetensors`, keys
`base_model.model.<module>.lora_A.weight` / `lora_B.weight`, so `peft.PeftModel.from_pretrained(base, DIR)` loads
what behemoth trained, and behemoth applies (or merges) what PEFT trained. Only plain LoRA is read: a folder with
DoRA, rsLoRA, per-module ranks or trained biases is refused by name.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from behemoth.errors import BehemothError
from behemoth.models.lora import LORA_A, LORA_B

PEFT_PREFIX = "base_model.model."
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
UNSUPPORTED = {"use_dora": False, "use_rslora": False, "fan_in_fan_out": False, "bias": "none", "rank_pattern": {}, "alpha_pattern": {}}


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter, full tensors by behemoth's parameter names (`<module>.lora_A.weight`), and its scaling."""

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    tensors: dict[str, torch.Tensor]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def delta(self, module: str) -> torch.Tensor | None:
        """(alpha / r) B A for one adapted module ([out, in], float32), or None if it has no adapter."""
        a, b = self.tensors.get(f"{module}.{LORA_A}.weight"), self.tensors.get(f"{module}.{LORA_B}.weight")
        if a is None or b is None:
            return None
        return (b.float() @ a.float()) * self.scaling

    def modules(self) -> list[str]:
        return sorted(k.removesuffix(f".{LORA_A}.weight") for k in self.tensors if k.endswith(f".{LORA_A}.weight"))


def peft_config(lora: Any, base: str | None) -> dict[str, Any]:
    """adapter_config.json for behemoth's LoRA settings (`finetune.lora`): plain LoRA on a causal LM."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": list(lora.targets),
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        **UNSUPPORTED,
    }


def write_adapter(out: Path, tensors: dict[str, torch.Tensor], lora: Any, base: str | None) -> Path:
    """Write a PEFT adapter folder (atomically per file) from full adapter tensors keyed by behemoth's names."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    weights = {PEFT_PREFIX + k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}
    for name, write in (
        (WEIGHTS_FILE, lambda p: save_file(weights, str(p), metadata={"format": "pt"})),
        (CONFIG_FILE, lambda p: p.write_text(json.dumps(peft_config(lora, base), indent=2))),
    ):
        tmp = out / f".{name}.tmp"
        write(tmp)
        os.replace(tmp, out / name)
    return out


def read_adapter(folder: str | Path) -> Adapter:
    """A PEFT LoRA folder as an `Adapter`; anything but plain LoRA is refused with the field that says so."""
    from safetensors.torch import load_file

    path = Path(folder).expanduser()
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
        raw = load_file(str(path / WEIGHTS_FILE))
    except (OSError, ValueError) as err:
        raise BehemothError(
            f"adapter {folder} has no readable {CONFIG_FILE} + {WEIGHTS_FILE} ({err.__class__.__name__})",
            "point at a folder written by behemoth or peft's save_pretrained",
        ) from None
    if config.get("peft_type") != "LORA":
        raise BehemothError(f"adapter {folder} is a {config.get('peft_type')!r} adapter", "behemoth applies LoRA adapters (peft_type LORA)")
    for key, plain in UNSUPPORTED.items():
        if config.get(key, plain) not in (plain, None):
            raise BehemothError(f"adapter {folder} sets {key}={config[key]!r}; behemoth applies plain LoRA", f"save it with {key}={plain!r}")
    tensors = {k.removeprefix(PEFT_PREFIX).replace(".default.", "."): v for k, v in raw.items()}
    odd = [k for k in tensors if not k.endswith((f".{LORA_A}.weight", f".{LORA_B}.weight"))]
    if odd:
        raise BehemothError(f"adapter {folder} holds {odd[0]}, not a LoRA matrix", "save only the LoRA weights (no modules_to_save)")
    targets = config.get("target_modules") or ()
    targets = (targets,) if isinstance(targets, str) else tuple(targets)  # peft also takes one regular expression
    return Adapter(int(config["r"]), float(config["lora_alpha"]), float(config.get("lora_dropout", 0.0)), targets, tensors)
