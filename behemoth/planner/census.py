"""What one rank holds of a model under tensor and expert parallelism, counted once per model: the planner's census.

Every block of a model has the same shape, so a one-block copy of the model, built on the meta device (no memory)
and split by the runtime's own functions (`rank.split_model`: the model's tensor-parallel plan, E / ep experts; on
meta, with no process group: the split is a function of the degrees alone), says what a rank holds of the
embedding, of each block (and of its experts) and of the head, padding of a vocabulary that t does not divide included. A plan of any
depth, pipeline cut and data-parallel degree is then a sum of those parts: no model is built per plan, so the
search can price thousands of plans of a 1T-parameter model in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from behemoth.models.activations import BlockActivations, block_activation_elements, lora_block_activations
from behemoth.models.causal_lm import CausalLM, build_causal_lm
from behemoth.models.lora import has_adapter, inject_lora
from behemoth.models.shape import ModelShape, training_flops_per_token
from behemoth.planner.rank import split_grid, split_model


@dataclass(frozen=True)
class TPShare:
    """Elements one rank of tensor-parallel degree `tp` and expert-parallel degree `ep` holds of each part of the model,
    and the per-token widths of what its weight-gradient passes need (the output gradient of every op that has a weight)."""

    tp: int
    embed: int  # first-stage modules: token (and position) embedding
    block: int  # one block
    head: int  # last-stage modules: final norm and an untied head
    tied: int  # the embedding weight a tied head reads (0 when untied); the last stage holds it too when pp > 1
    vocab: int  # vocabulary rows of the head (or tied embedding) on this rank, padding included
    block_weight_outputs: int  # per token: outputs of a block's linear layers plus its norms' widths
    head_weight_outputs: int  # per token: the head's logits plus the final norm's width
    ep: int = 1
    experts: int = 0  # of `block`: its expert weights (E / ep experts), synchronised over dp alone
    frozen: tuple[int, int, int, int] = (0, 0, 0, 0)  # (embed, block, head, tied) elements without gradients: a LoRA base

    def stage_elements(self, blocks: int, *, first: bool, last: bool, pp: int) -> int:
        """Parameters of one pipeline stage of `blocks` blocks; with a tied head the last stage keeps the embedding too."""
        return _stage_sum((self.embed, self.block, self.head, self.tied), blocks, first=first, last=last, pp=pp)

    def stage_frozen(self, blocks: int, *, first: bool, last: bool, pp: int) -> int:
        """Of `stage_elements`, the frozen ones (no gradient, no optimizer state, never sharded by ZeRO 1-2)."""
        return _stage_sum(self.frozen, blocks, first=first, last=last, pp=pp)


def _stage_sum(parts: tuple[int, int, int, int], blocks: int, *, first: bool, last: bool, pp: int) -> int:
    embed, block, head, tied = parts
    again = tied if last and not first and pp > 1 else 0
    return blocks * block + (embed if first else 0) + (head + again if last else 0)


@dataclass
class ModelCensus:
    """A model's shape, its parameter count and FLOPs, and every tensor-parallel degree's share of it (computed lazily)."""

    model_cfg: Any
    hf: Any
    shape: ModelShape
    psi: int  # parameters of the whole model
    matmul_params: int  # parameters a token is multiplied by (the MFU count)
    activations: BlockActivations
    lora: Any = None  # finetune.lora when it is enabled: the base is frozen, the adapters train
    _shares: dict[tuple[int, int, str, int], TPShare] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, model_cfg: Any, hf: Any = None, lora: Any = None) -> ModelCensus:
        """Count the model `model_cfg` (and `hf`) describe, with `lora`'s adapters, from a one-block copy on meta."""
        lora = lora if lora is not None and lora.enabled else None
        one = _one_block(model_cfg, hf, lora)
        share = _share(one, 1)
        shape = _full_shape(one.shape, model_cfg)
        extra = (shape.n_layer - 1) * share.block
        activations = block_activation_elements(shape)
        if lora is not None:
            activations = lora_block_activations(activations, shape, lora.rank, _adapted(one))
        psi, matmul = _count(one.module) + extra, one.matmul_params + extra
        if shape.experts:  # an MoE block's share holds every expert; a token multiplies by its k (and blocks may alternate)
            matmul = one.matmul_params + sum(shape.block_matrix_params(i) for i in range(1, shape.n_layer))
            psi = model_cfg.num_params() if not getattr(hf, "arch", None) else psi
        census = cls(model_cfg, hf, shape, psi, matmul, activations, lora)
        census._shares[(1, 1, "1d", 1)] = share
        return census

    def at(self, tp: int, ep: int = 1, mode: str = "1d", depth: int = 1) -> TPShare:
        """What one rank of a tensor-parallel group of `tp` and an expert-parallel group of `ep` holds; `mode` 2d, 2.5d
        (`depth` grids) or 3d: the one-block copy split by the runtime's own grid or cube layout (`rank.split_grid`):
        1/q^2 of every parameter on a 2-D or 2.5-D grid, 1/q^3 on a cube, norms and biases included; the head's
        vocabulary and every per-token width at 1/tp (a rank computes its sequences' share of its vocabulary block:
        1/tp of the logits in every mode; the refusals guarantee the sizes split)."""
        key = (tp, ep, mode if tp > 1 else "1d", depth if mode == "2.5d" and tp > 1 else 1)
        if key not in self._shares:
            one = _one_block(self.model_cfg, self.hf, self.lora)
            if key[2] == "1d":
                self._shares[key] = _share(one, tp, ep)
            else:
                whole = self.at(1, ep)
                split_grid(one, tp, key[2], key[3])
                counted = _share(one, 1, ep)
                self._shares[key] = replace(
                    counted,
                    tp=tp,
                    vocab=whole.vocab // tp,
                    block_weight_outputs=whole.block_weight_outputs // tp,
                    head_weight_outputs=whole.head_weight_outputs // tp,
                )
        return self._shares[key]

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs of a training step per token, as `CausalLM.flops_per_token` counts them (models/shape.py)."""
        return training_flops_per_token(self.shape, self.matmul_params, seq_len)


def _full_shape(one: ModelShape, model_cfg: Any) -> ModelShape:
    """The one-block copy's shape with the real depth."""
    from dataclasses import replace

    if not one.experts:
        return replace(one, n_layer=model_cfg.n_layer)
    if one.arch != "gpt":  # a Hugging Face MoE family: every block alike
        return replace(one, n_layer=model_cfg.n_layer, experts=one.experts[:1] * model_cfg.n_layer)
    return replace(one, n_layer=model_cfg.n_layer, experts=tuple(model_cfg.moe.experts_per_block(model_cfg.n_layer)))  # each block's own


def _one_block(model_cfg: Any, hf: Any, lora: Any) -> CausalLM:
    """A one-block copy of the model on the meta device, its base frozen and adapted when `lora` is given (as
    parallelize does before the tensor-parallel split)."""
    moe = getattr(model_cfg, "moe", None)
    if moe is not None and moe.enabled and not getattr(hf, "arch", None):  # a GPT whose MoE blocks alternate: count each as an MoE block
        widest = max(moe.experts) if isinstance(moe.experts, list) else moe.experts
        model_cfg = model_cfg.model_copy(update={"moe": moe.model_copy(update={"every": 1, "experts": widest})})
    lm = build_causal_lm(model_cfg.model_copy(update={"n_layer": 1}), hf)
    if lora is not None:
        inject_lora(lm, lora)
    return lm


def _adapted(lm: CausalLM) -> frozenset[str]:
    """The module names (last part) of the linears with an adapter in the one block of `lm`."""
    block = lm.module.get_submodule(lm.layers.blocks)[0]
    return frozenset(name.rsplit(".", 1)[-1] for name, module in block.named_modules() if has_adapter(module))


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _share(lm: CausalLM, tp: int, ep: int = 1) -> TPShare:
    """Split a one-block meta model as tensor and expert parallelism of degrees `tp` and `ep` would and count its parts
    (rank 0: every rank holds equal shapes, the vocabulary padded to a multiple of tp)."""
    is_expert = split_model(lm, tp, ep)
    model, view = lm.module, lm.layers
    block = model.get_submodule(view.blocks)[0]
    embedding = model.get_submodule(view.embedding).weight
    parts = {"first": _params_under(model, view.first), "last": _params_under(model, view.last)}
    tied = embedding.numel() if lm.shape.tied else 0
    head = sum(p.numel() for p in parts["last"].values() if p is not embedding)
    experts = sum(p.numel() for name, p in block.named_parameters() if is_expert is not None and is_expert(f"{view.blocks}.0.{name}"))
    frozen = (
        sum(p.numel() for p in parts["first"].values() if not p.requires_grad),
        sum(p.numel() for p in block.parameters() if not p.requires_grad),
        sum(p.numel() for p in parts["last"].values() if p is not embedding and not p.requires_grad),
        tied if not embedding.requires_grad else 0,
    )
    return TPShare(
        tp,
        sum(p.numel() for p in parts["first"].values()),
        _count(block),
        head,
        tied,
        vocab=embedding.shape[0],
        block_weight_outputs=_weight_outputs(block, lm.transposed, f"{view.blocks}.0"),
        head_weight_outputs=embedding.shape[0] + lm.shape.d_model,
        ep=ep,
        experts=experts,
        frozen=frozen,
    )


def _params_under(model: nn.Module, names: tuple[str, ...]) -> dict[int, nn.Parameter]:
    """Distinct parameters of the modules `names` name (absent ones, such as a tied model's missing head, skipped)."""
    out: dict[int, nn.Parameter] = {}
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:
            continue
        if isinstance(module, nn.Module):
            out.update({id(p): p for p in module.parameters()})
    return out


def _weight_outputs(block: nn.Module, transposed: frozenset[str], prefix: str) -> int:
    """Per token, the output width of every op with a weight in `block`: linear layers' output features (a transposed
    [in, out] weight's second dimension) and norms' widths."""
    total = 0
    for name, module in block.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, nn.Parameter):
            continue
        full = f"{prefix}.{name}" if name else prefix
        total += weight.shape[-1] if weight.dim() == 2 and full in transposed else weight.shape[0]
    return total
