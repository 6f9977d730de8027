"""transformers' Mixtral under behemoth's MoE layer: the model class unmodified, its sparse MLPs computed by `MoELayer`.

Each decoder layer's `mlp` (a `MixtralSparseMoeBlock`: `gate`, a top-k router, and `experts`, stacked
`gate_up_proj` [E, 2F, d] and `down_proj` [E, d, F]) is replaced by an `MoELayer` that adopts the same
two children under the same names, so parameter names, shapes and initialization are transformers'
own, and dropless routing gives the logits transformers gives. The layer adds what the transformers
block lacks: capacity and dropping, the auxiliary losses added to the training objective, usage
statistics, and a runner that `parallel/expert/` can place over the `ep` ranks.

The objective is the one the config defines, recorded in `model.moe` (so config.yaml says what trains):
transformers' load-balancing loss pooled over all layers and tokens (`aux_loss=pooled`, models/moe.py),
weighed by `router_aux_loss_coef` when `output_router_logits` is true and absent otherwise (`aux_coef=0`),
no z-loss; `router_jitter_noise` jitters the MLP's input while training, as transformers does. A
`model.moe.*` option the user sets overrides its field (the launch line names it). Checkpoints written by
`save_pretrained` keep the older per-expert layout (`block_sparse_moe.experts.E.w1/w2/w3`); `from_legacy`
reads it (`behemoth export --hf` writes it through transformers' own save_pretrained).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from behemoth.models.moe import ExpertSpec, MoEConfig, MoELayer, RouterStats

# the MoE input: experts enter the TP region themselves; under SP the norm's output is gathered for the layer
MOE_EXTRA_PLAN = {"model.layers.*.post_attention_layernorm": "sequence_replicate"}
LEGACY = re.compile(r"^(.*\.layers\.\d+)\.block_sparse_moe\.(?:experts\.(\d+)\.(w[123])\.weight|gate\.weight)$")


def mixtral_moe_fields(c: dict[str, Any]) -> dict[str, Any]:
    """The model.moe fields a Mixtral config.json's shape sets (an option that disagrees is refused)."""
    return {"experts": c.get("num_local_experts", 8), "top_k": c.get("num_experts_per_tok", 2)}


def moe_objective(c: dict[str, Any]) -> dict[str, Any]:
    """The model.moe fields of the objective a Mixtral config (config.json, or transformers' defaults for the keys it
    lacks) defines: the pooled load-balancing loss, weighed only when output_router_logits is true; no z-loss."""
    import transformers

    defaults = transformers.MixtralConfig()
    coef = float(c.get("router_aux_loss_coef", defaults.router_aux_loss_coef))
    jitter = float(c.get("router_jitter_noise", defaults.router_jitter_noise) or 0.0)
    on = bool(c.get("output_router_logits", defaults.output_router_logits))
    out = {"aux_loss": "pooled", "aux_coef": coef if on else 0.0, "z_coef": 0.0, "normalize": "chosen", "noise": "none"}
    return out | ({"noise": "jitter", "noise_eps": jitter} if jitter else {})


def moe_overrides(moe: MoEConfig, c: dict[str, Any]) -> dict[str, Any]:
    """config.json fields the model.moe section changes: whether the load-balancing loss is added and its weight, the jitter."""
    want: dict[str, Any] = {}
    if moe.aux_coef != moe_objective(c)["aux_coef"]:
        want["output_router_logits"] = moe.aux_coef > 0
        if moe.aux_coef > 0:
            want["router_aux_loss_coef"] = moe.aux_coef
    jitter = moe.noise_eps if moe.noise == "jitter" else 0.0
    if jitter != float(c.get("router_jitter_noise") or 0.0):
        want["router_jitter_noise"] = jitter
    return want


def mixtral_config_fields(moe: MoEConfig) -> dict[str, Any]:
    """Mixtral config fields from the model.moe section (a Mixtral built from behemoth's options)."""
    return {
        "num_local_experts": moe.experts,
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_coef,
        "output_router_logits": moe.aux_coef > 0,
        "router_jitter_noise": moe.noise_eps if moe.noise == "jitter" else 0.0,
        "sliding_window": None,
    }


def moe_model_problems(moe: MoEConfig, arch: str, plan: Any = None) -> list[str]:
    """Why model.moe cannot describe this transformers model (or its objective cannot run under `plan`)."""
    if arch != "mixtral":
        return [f"model.moe.experts={moe.experts}: hf:{arch} has no experts; use model=hf:mixtral or leave model.moe.experts unset"]
    out = []
    if plan is not None and plan.pp > 1 and moe.aux_loss == "pooled" and moe.aux_coef:
        out.append(
            f"parallel.pp={plan.pp}: the load-balancing loss this Mixtral trains (transformers' pooled over every layer, "
            f"model.moe.aux_coef={moe.aux_coef}) needs all of its layers in one process; use dp/ep/tp/ZeRO, or "
            "model.moe.aux_coef=0 or model.moe.aux_loss=topk (per layer) with pp"
        )
    if isinstance(moe.experts, list) or moe.experts < 1:
        out.append(f"model.moe.experts={moe.experts}: a Mixtral has one expert count for every layer; set e.g. model.moe.experts=8")
    if moe.every != 1:
        out.append(f"model.moe.every={moe.every}: every Mixtral layer has experts; leave model.moe.every=1")
    if moe.shared_expert:
        out.append("model.moe.shared_expert=true: a Mixtral has no shared expert; leave it false")
    return out


def mixtral_policy(moe: MoEConfig, config: Any) -> Any:
    """The routing policy: model.moe as recorded (the config's objective, and what the user overrode), with Mixtral's k;
    jitter multiplies the whole MLP input, as transformers' sparse block does."""
    return dataclasses.replace(moe.policy(), top_k=config.num_experts_per_tok, jitter_experts=True)


def adopt_moe_blocks(model: nn.Module, moe: MoEConfig) -> tuple[tuple[str, ...], RouterStats]:
    """Replace every decoder layer's sparse MLP by an `MoELayer` holding the same router and experts."""
    config = model.config
    E = config.num_local_experts
    stats = RouterStats([E] * config.num_hidden_layers)
    policy = mixtral_policy(moe, config)
    names = []
    for i, layer in enumerate(model.model.layers):
        block = layer.mlp
        spec = ExpertSpec(E, router="gate", experts="experts", w_in="gate_up_proj", w_out="down_proj", gated=True, act=block.experts.act_fn)
        layer.mlp = MoELayer(spec, policy, index=i, stats=stats, router=block.gate, experts=block.experts)
        names.append(f"model.layers.{i}.mlp")
    return tuple(names), stats


def from_legacy(tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors by the model's names, from a save_pretrained file that may hold per-expert w1 (gate), w3 (up), w2 (down)."""
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, t in tensors:
        m = LEGACY.match(key)
        if m is None:
            yield key, t
        elif m.group(2) is None:
            yield f"{m.group(1)}.mlp.gate.weight", t
        else:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    for layer, by_expert in experts.items():
        ordered = [by_expert[e] for e in sorted(by_expert)]
        yield f"{layer}.mlp.experts.gate_up_proj", torch.stack([torch.cat([w["w1"], w["w3"]]) for w in ordered])
        yield f"{layer}.mlp.experts.down_proj", torch.stack([w["w2"] for w in ordered])
