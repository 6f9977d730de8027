"""One view of every causal language model behemoth trains: behemoth's GPT or a Hugging Face model.

The engine needs the same few things from each: the module (on the meta device), how its parameters
are initialized by name, its tensor-parallel plan (data: module-name pattern -> style), how to get
logits from token ids, and what to do once its parameters have storage (tied weights, loaded weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from behemoth.models.gpt import build_gpt
from behemoth.models.init import InitSpec

# behemoth's GPT (models/gpt.py). The tied head (tie_embeddings) reads wte.weight, which `vocab` already splits.
GPT_TP_PLAN: dict[str, str] = {
    "wte": "vocab",
    "wpe": "position_embedding",
    "blocks.0": "sequence_input",
    "blocks.*.ln_1": "sequence_norm",
    "blocks.*.attn.qkv": "packed_colwise:3",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.ln_2": "sequence_norm",
    "blocks.*.mlp.fc": "colwise",
    "blocks.*.mlp.proj": "rowwise",
    "ln_f": "sequence_norm",
    "lm_head": "vocab",
}

Tie = list[tuple[str, str]]  # (module name, attribute) slots that share one parameter


def summed_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in float32: the loss every layout computes (divided by the global token count later)."""
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")


@dataclass
class CausalLM:
    """A model on the meta device and what the engine needs to build and run it."""

    module: nn.Module
    init_spec: Callable[[str], InitSpec]
    tp_plan: dict[str, str]
    logits_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    arch: str = "gpt"
    weights: str | None = None
    matmul_params: int = 0  # parameters a token's forward multiplies by (all but position tables), counted before any cut

    def flops_per_token(self, n_layer: int, d_model: int, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6N plus attention scores (PaLM appendix B)."""
        return 6 * self.matmul_params + 12 * n_layer * d_model * seq_len

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        return self.module(idx) if self.logits_fn is None else self.logits_fn(self.module, idx)

    def after_tensor_parallel(self, tp: int) -> None:
        """Per-instance widths a model reads in forward (GPT-2's split_size) follow the tp split."""
        if self.arch == "gpt2":
            from behemoth.models.hf import adapt_attention_width

            adapt_attention_width(self.module, self.arch, tp)

    def after_materialize(self, device: torch.device) -> None:
        """Move buffers to the device and load weights from hf.weights (materialize gave the parameters values)."""
        for owner in self.module.modules():
            for name, buf in owner.named_buffers(recurse=False):
                if buf is not None and buf.device != device:
                    owner._buffers[name] = buf.to(device)
        if self.weights:
            from behemoth.models.hf import load_weights

            load_weights(self.module, self.weights)


def build_causal_lm(model_cfg: Any, hf: Any = None) -> CausalLM:
    """behemoth's GPT, or the transformers model `hf.arch` names, on the meta device."""
    if hf is None or hf.arch is None:
        gpt = build_gpt(model_cfg)
        return CausalLM(gpt, gpt.init_spec, dict(GPT_TP_PLAN), matmul_params=model_cfg.num_params() - model_cfg.context * model_cfg.d_model)
    from behemoth.models.hf import build_hf, hf_init_spec, hf_logits, hf_tp_plan

    model = build_hf(model_cfg, hf)
    positions = model.get_submodule("transformer.wpe").weight.numel() if hf.arch == "gpt2" else 0  # Llama: rotary, no table
    return CausalLM(model, hf_init_spec(model, hf.arch), hf_tp_plan(model, hf.arch), hf_logits, hf.arch, hf.weights,
                    matmul_params=sum(p.numel() for p in model.parameters()) - positions)


def tied_names(model: nn.Module) -> dict[str, list[str]]:
    """First name -> the other names of every parameter registered in several places (a tied LM head)."""
    return {".".join(filter(None, group[0])): [".".join(filter(None, slot)) for slot in group[1:]] for group in find_ties(model)}


def find_ties(model: nn.Module) -> list[Tie]:
    """Every group of parameter slots that hold the same Parameter object (e.g. a tied LM head)."""
    slots: dict[int, Tie] = {}
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            slots.setdefault(id(p), []).append((mname, pname))
    return [group for group in slots.values() if len(group) > 1]

