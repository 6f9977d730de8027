"""LoRA (Hu et al. 2021): a frozen linear layer W plus a trained low-rank update, y = W x + (alpha / r) B A x.

`inject_lora` runs on the model on the meta device, before any parallel transform: each targeted linear layer gets
two float32 children, `lora_A` [r, in] and `lora_B` [out, r], and a forward hook that adds their product; every
other parameter is frozen (no gradient buffer, no optimizer state). Parameter names are PEFT's without its
`base_model.model.` prefix and adapter name (`...q_proj.lora_A.weight`), so saving in its layout is a rename.

Initialization is layout independent like every other parameter's: A is drawn from (seed, name) with the variance
of PEFT's default (kaiming-uniform with a = sqrt(5): variance 1 / (3 fan_in)), B is zero, so the adapted model
starts as the base model. Tensor parallelism splits an adapter with its base layer (parallel/tensor/adapters.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from behemoth.errors import BehemothError
from behemoth.models.init import ADAPTER, InitSpec

LORA_A, LORA_B, LORA_DROPOUT, LORA_SCALING = "lora_A", "lora_B", "lora_dropout", "lora_scaling"
LORA_HOOK = "_behemoth_lora_hook"  # the forward hook's handle on the adapted layer


def matches_target(name: str, targets: tuple[str, ...]) -> bool:
    """PEFT's rule for a list of target_modules: the module's name is a target or ends with `.target`."""
    return any(name == t or name.endswith(f".{t}") for t in targets)


def target_modules(model: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """Names of the linear layers `targets` selects; a selected module that is not nn.Linear is refused."""
    found = [n for n, _ in model.named_modules() if n and matches_target(n, targets)]
    if not found:
        raise BehemothError(
            f"finetune.lora.targets={list(targets)} matches no module of this model",
            "name linear modules of the model, e.g. finetune.lora.targets=[q_proj,v_proj]",
        )
    odd = [n for n in found if type(model.get_submodule(n)) is not nn.Linear]
    if odd:
        kind = type(model.get_submodule(odd[0])).__name__
        raise BehemothError(f"finetune.lora targets {odd[0]}, a {kind}; LoRA adapts nn.Linear layers", "leave it out of finetune.lora.targets")
    return found


def add_low_rank(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """Forward hook: the base layer's output plus (alpha / r) B A dropout(x), computed in the adapters' dtype."""
    a = getattr(module, LORA_A)
    x = getattr(module, LORA_DROPOUT)(args[0].to(a.weight.dtype))
    delta = getattr(module, LORA_B)(a(x)) * getattr(module, LORA_SCALING)
    return out + delta.to(out.dtype)


def attach_adapter(module: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
    """Give one linear layer its adapter (on the device its weight is on, meta before materialize) and its hook."""
    device = module.weight.device
    a = nn.Linear(module.in_features, rank, bias=False, device=device, dtype=torch.float32)
    b = nn.Linear(rank, module.out_features, bias=False, device=device, dtype=torch.float32)
    for p in (a.weight, b.weight):
        setattr(p, ADAPTER, True)
    setattr(module, LORA_A, a)
    setattr(module, LORA_B, b)
    setattr(module, LORA_DROPOUT, nn.Dropout(dropout) if dropout else nn.Identity())
    setattr(module, LORA_SCALING, alpha / rank)
    setattr(module, LORA_HOOK, module.register_forward_hook(add_low_rank))


def lora_init_spec(base: Callable[[str], InitSpec], fan_in: dict[str, int]) -> Callable[[str], InitSpec]:
    """The model's own init for its parameters; for adapters, A ~ N(0, 1 / (3 fan_in)) (PEFT's variance) and B = 0."""

    def spec(name: str) -> InitSpec:
        if name.endswith(f"{LORA_B}.weight"):
            return InitSpec("zeros")
        if name.endswith(f"{LORA_A}.weight"):
            return InitSpec("normal", 1.0 / math.sqrt(3 * fan_in[name]))
        return base(name)

    return spec


def inject_lora(lm: Any, lora: Any) -> list[str]:
    """Freeze `lm` (a CausalLM on the meta device) and adapt the linear layers `lora.targets` names; the adapted names."""
    model = lm.module
    names = target_modules(model, tuple(lora.targets))
    for p in model.parameters():
        p.requires_grad_(False)
    fan_in = {}
    for name in names:
        module = model.get_submodule(name)
        attach_adapter(module, lora.rank, lora.alpha, lora.dropout)
        fan_in[f"{name}.{LORA_A}.weight"] = module.in_features
    lm.init_spec = lora_init_spec(lm.init_spec, fan_in)
    return names


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapters' parameters by name (this rank's parts of them)."""
    return {n: p for n, p in model.named_parameters() if hasattr(p, ADAPTER)}


def has_adapter(module: nn.Module) -> bool:
    return isinstance(getattr(module, LORA_A, None), nn.Linear)


@torch.no_grad()
def merge_adapters(model: nn.Module) -> int:
    """Fold every adapter into its layer's weight, W += (alpha / r) B A, and remove it (for generation: no extra matmuls,
    and int8 quantization sees the merged weight). Each rank's parts suffice: a column-parallel layer holds B's rows for
    its W rows and all of A, a row-parallel one all of B and A's columns for its W columns. The layers merged."""
    merged = 0
    for module in model.modules():
        if not has_adapter(module):
            continue
        a, b, w = getattr(module, LORA_A).weight, getattr(module, LORA_B).weight, module.get_parameter("weight")
        w.add_(((b @ a) * getattr(module, LORA_SCALING)).to(w.dtype))
        getattr(module, LORA_HOOK).remove()
        for attr in (LORA_A, LORA_B, LORA_DROPOUT, LORA_SCALING, LORA_HOOK):
            delattr(module, attr)
        merged += 1
    return merged


INT8_WEIGHT, INT8_SCALE = "weight_int8", "weight_scale"  # buffers of a base layer quantized by `quantize_base`


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale per output row) of a [out, in] weight: symmetric, scale = max |w| / 127 over the row."""
    scale = w.detach().abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 127.0
    return torch.round(w.detach().float() / scale).clamp(-127, 127).to(torch.int8), scale


class Int8Linear(torch.autograd.Function):
    """x W^T for an int8 W with per-row scales: W is rebuilt in x's dtype for the product and again for the input's
    gradient, so autograd keeps the int8 weight (1 byte per element), never a float copy; no gradient for W."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(q, scale)
        return torch.nn.functional.linear(x, q.to(x.dtype) * scale.to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        q, scale = ctx.saved_tensors
        return grad @ (q.to(grad.dtype) * scale.to(grad.dtype)), None, None


def int8_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A quantized base layer's forward (its adapter's hook adds the low-rank term after, as for a float layer)."""
    out = Int8Linear.apply(x, getattr(self, INT8_WEIGHT), getattr(self, INT8_SCALE))
    return out if self.bias is None else out + self.bias


@torch.no_grad()
def quantize_base(model: nn.Module, blocks: str) -> int:
    """QLoRA-style: every frozen nn.Linear weight under `blocks` (attention and MLP; embeddings, norms and the head stay
    float) becomes int8 with a scale per output channel, its float weight freed. Returns the bytes the base gave up."""
    saved = 0
    for module in model.get_submodule(blocks).modules():
        if type(module) is not nn.Linear or module.weight.requires_grad:  # adapters are trained, in float32
            continue
        q, scale = quantize_per_channel(module.weight)
        saved += module.weight.numel() * module.weight.element_size() - q.numel() - scale.numel() * 4
        del module._parameters["weight"]
        module.register_buffer(INT8_WEIGHT, q)
        module.register_buffer(INT8_SCALE, scale)
        module.forward = int8_forward.__get__(module)  # type: ignore[method-assign]  # this one layer computes from int8
    return saved
