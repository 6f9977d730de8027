"""One interface to every causal language model behemoth trains: behemoth's GPT or a Hugging Face model.

The parallel layers, the engine and the planner ask a `CausalLM` what they need — its layered view
(embedding, blocks, head, and how to run a stage of them), its tensor-parallel plan, which linear
layers hold a transposed weight, which modules are norms, its shape (`ModelShape`), its FLOPs and
its KV-cache shape — and never look at the model's classes themselves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from behemoth.models.chunked_loss import ChunkedHead, chunked_cross_entropy_sum, head_input_of
from behemoth.models.gpt import GPT_TP2D_PLAN, GPT_TP3D_PLAN, build_gpt, gpt_tp_plan
from behemoth.models.init import InitSpec, materialize
from behemoth.models.layered import LayeredView, view_of
from behemoth.models.moe import MoELayer, MoELayerCost, RouterStats, moe_layer_costs
from behemoth.models.shape import LayerCosts, ModelShape, hardware_flops_per_token, median_pass_seconds, training_flops_per_token

Tie = list[tuple[str, str]]  # (module name, attribute) slots that share one parameter
IGNORE_INDEX = -100  # a target the loss leaves out (a chat's prompt tokens), as in PyTorch and transformers


def summed_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed token cross-entropy in float32 over the targets that are not IGNORE_INDEX: the loss every layout computes
    (divided by the global count of such targets later). A deferred head's output (models/chunked_loss.py) is taken
    chunk by chunk, its logits never whole."""
    if head_input_of(logits) is not None:
        return chunked_cross_entropy_sum(logits, targets)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum", ignore_index=IGNORE_INDEX)


def counted_targets(targets: torch.Tensor) -> torch.Tensor:
    """How many of the targets the loss counts (those that are not IGNORE_INDEX)."""
    return (targets != IGNORE_INDEX).sum()


@dataclass
class CausalLM:
    """A model on the meta device and what the parallel layers need to know about it."""

    module: nn.Module
    shape: ModelShape
    layers: LayeredView
    init_spec: Callable[[str], InitSpec]
    tp_plan: dict[str, str]
    transposed: frozenset[str] = frozenset()  # linear modules whose weight is [in, out] (GPT-2's Conv1D)
    norms: frozenset[str] = frozenset()  # every normalization module (sequence parallelism must style each)
    logits_fn: Callable[..., torch.Tensor] | None = None  # (module, idx[, positions]) -> logits
    weights: str | None = None
    matmul_params: int = 0  # parameters a token's forward multiplies by (not position tables, not an untied input embedding: a lookup)
    on_tensor_parallel: Callable[[nn.Module, int], None] | None = field(default=None, repr=False)
    time_layers: Callable[[int, int, torch.device], LayerCosts] | None = field(default=None, repr=False)  # (seq_len, micro_batch, device)
    moe_layers: tuple[str, ...] = ()  # module names of the MoE MLPs (models/moe.py's MoELayer)
    routers: RouterStats | None = field(default=None, repr=False)  # their auxiliary losses and expert usage
    tp2d_plan: dict[str, str] | None = None  # the 2-D tensor-parallel plan (parallel.tp_mode=2d), where the model has one
    tp3d_plan: dict[str, str] | None = None  # the 3-D one (parallel.tp_mode=3d)

    def moe_costs(self) -> list[MoELayerCost]:
        """Per MoE layer: experts, k, widths, FLOPs per token, parameters per expert, all-to-all bytes (for the planner)."""
        return moe_layer_costs(self.shape)

    @property
    def arch(self) -> str:
        return self.shape.arch

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per token of a training step (forward + backward), the basis of MFU (models/shape.py counts them)."""
        return training_flops_per_token(self.shape, self.matmul_params, seq_len)

    def hardware_flops_per_token(self, seq_len: int, recomputed_blocks: float = 0.0) -> float:
        """FLOPs a device really executes per token, recomputed blocks included, the basis of HFU."""
        return hardware_flops_per_token(self.shape, self.matmul_params, seq_len, recomputed_blocks)

    def kv_cache_shape(self, batch: int, seq_len: int, tp: int = 1) -> tuple[int, ...]:
        """Keys and values one rank caches per layer: [2, batch, kv_heads / tp, seq_len, head_dim]."""
        return (2, batch, self.shape.kv_heads // tp, seq_len, self.shape.head_dim)

    def logits(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of token ids [B, T]; `positions` [B, T]: where the tokens stand in their sequence (default 0 .. T-1)."""
        if positions is None:
            return self.module(idx) if self.logits_fn is None else self.logits_fn(self.module, idx)
        return self.module(idx, positions) if self.logits_fn is None else self.logits_fn(self.module, idx, positions)

    def chunked_head(self, loss_chunk: int, fuse: bool = True) -> ChunkedHead | None:
        """Let the head's projection leave its input to a chunked loss (`train.loss_chunk`; models/chunked_loss.py), or
        None: chunking off, no head on this rank (an earlier pipeline stage), or a head with forward hooks (a LoRA
        adapter on it: its output is more than the projection). `fuse`: a micro-batch below the chunking size takes the
        fused head + loss (False: the plain projection, as under ZeRO-3, whose head weight lives in its unit's window)."""
        if loss_chunk == 0:
            return None
        head = getattr(self.module, "lm_head", None)
        if head is not None:
            if head._forward_hooks or not getattr(head, "chunkable", True):  # hooks, or a head computed across ranks (2-D TP)
                return None
            params = lambda: (head.weight, getattr(head, "bias", None), bool(getattr(head, "transposed", False)))  # noqa: E731  # read at each call
            return ChunkedHead(head, "forward", params, loss_chunk, fuse)
        if self.logits_fn is None and self.shape.tied and getattr(self.module, "wte", None) is not None:  # behemoth's GPT, tied
            wte: Any = self.module.get_submodule("wte")  # looked up now, its weight at each call (ZeRO-3 installs it)
            return ChunkedHead(self.module, "project", lambda: (wte.weight, None, False), loss_chunk, fuse)
        return None

    def after_tensor_parallel(self, tp: int) -> None:
        """Per-instance widths a model reads in forward (GPT-2's split_size) follow the tp split."""
        if self.on_tensor_parallel is not None and tp > 1:
            self.on_tensor_parallel(self.module, tp)

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
    lm = _build(model_cfg, hf)
    lm.time_layers = functools.partial(measure_layer_costs, model_cfg, hf)
    return lm


def _build(model_cfg: Any, hf: Any) -> CausalLM:
    if hf is None or hf.arch is None:
        gpt = build_gpt(model_cfg)
        norms = frozenset(n for n, m in gpt.named_modules() if isinstance(m, nn.LayerNorm))
        return CausalLM(
            gpt,
            model_cfg.shape(),
            view_of("gpt"),
            gpt.init_spec,
            gpt_tp_plan(model_cfg),
            norms=norms,
            matmul_params=model_cfg.num_params(active=True)
            - model_cfg.context * model_cfg.d_model
            - (0 if model_cfg.tie_embeddings else model_cfg.vocab_size * model_cfg.d_model),  # a lookup, not a matmul
            moe_layers=tuple(n for n, m in gpt.named_modules() if isinstance(m, MoELayer)),
            routers=gpt.routers,
            tp2d_plan=GPT_TP2D_PLAN,
            tp3d_plan=GPT_TP3D_PLAN,
        )
    from behemoth.models import hf as hf_models
    from behemoth.models.hf_families import DECODER_VIEW, tp2d_plan, tp3d_plan

    hf_models.require_transformers()
    config = hf_models.transformers_config(model_cfg, hf)
    model = hf_models.build_hf(config, hf.arch)
    positions = model.get_submodule("transformer.wpe").weight.numel() if hf.arch == "gpt2" else 0  # Llama: rotary, no table
    shape = hf_models.hf_shape(config, hf.arch)
    moe_layers, routers, inactive = (), None, 0
    if shape.experts:
        from behemoth.models.hf_moe import adopt_moe_blocks

        moe_layers, routers = adopt_moe_blocks(model, model_cfg.moe)
        inactive = sum(c.experts - c.top_k for c in moe_layer_costs(shape)) * 3 * shape.d_model * shape.ffn
    lookup = 0 if shape.tied else model.get_input_embeddings().weight.numel()  # an untied input embedding is a lookup, not a matmul
    return CausalLM(
        model,
        shape,
        view_of("gpt2") if hf.arch == "gpt2" else DECODER_VIEW,
        hf_models.hf_init_spec(model, hf.arch),
        hf_models.hf_tp_plan(model, hf.arch),
        transposed=hf_models.transposed_linears(model),
        norms=hf_models.norm_modules(model),
        logits_fn=hf_models.hf_logits,
        weights=hf.weights,
        matmul_params=sum(p.numel() for p in model.parameters()) - positions - inactive - lookup,
        on_tensor_parallel=hf_models.tensor_parallel_hook(hf.arch),
        moe_layers=moe_layers,
        routers=routers,
        tp2d_plan=tp2d_plan(hf.arch),
        tp3d_plan=tp3d_plan(hf.arch),
    )


def model_shape(model_cfg: Any, hf: Any = None) -> ModelShape:
    """The shape of the model a config describes, without building it."""
    if hf is None or hf.arch is None:
        return model_cfg.shape()
    from behemoth.models import hf as hf_models

    hf_models.require_transformers()
    return hf_models.hf_shape(hf_models.transformers_config(model_cfg, hf), hf.arch)


def num_params(model_cfg: Any, hf: Any = None) -> int:
    """Parameters of the model a config describes (a Hugging Face family's counted on the meta device, a tied head once)."""
    if hf is None or hf.arch is None:
        return int(model_cfg.num_params())
    from behemoth.models import hf as hf_models

    hf_models.require_transformers()
    return sum(p.numel() for p in hf_models.build_hf(hf_models.transformers_config(model_cfg, hf), hf.arch).parameters())


def has_tp2d_plan(arch: str, mode: str = "2d") -> bool:
    """Whether models of the family `arch` (a ModelShape's) have a 2-D tensor-parallel plan (parallel.tp_mode=2d, 2.5d),
    or with mode="3d" a 3-D one."""
    from behemoth.models.hf_families import tp2d_plan, tp3d_plan

    return arch == "gpt" or (tp3d_plan if mode == "3d" else tp2d_plan)(arch) is not None


def model_problems(model_cfg: Any, hf: Any = None, plan: Any = None) -> list[str]:
    """Why the model a config describes cannot be built as asked, or run under `plan` (empty for behemoth's GPT, which
    takes any shape)."""
    if hf is None or hf.arch is None:
        return []
    from behemoth.models import hf as hf_models

    return hf_models.model_problems(model_cfg, hf, plan)


def measure_layer_costs(model_cfg: Any, hf: Any, seq_len: int, micro_batch: int, device: torch.device, reps: int = 3) -> LayerCosts:
    """Measured forward + backward seconds of the embedding, one block and the head for one micro-batch.

    Blocks of one kind have the same shape, so a one-block copy of the model is built and timed, its block's time used
    for each (with experts, a dense and an MoE block are timed, each used for the blocks of its kind). Its random
    weights and inputs come from their own generators: the process-wide RNG is not touched.
    """
    gpt = hf is None or hf.arch is None  # a transformers model's blocks are all alike
    experts = model_cfg.moe.experts_per_block(model_cfg.n_layer) if gpt else [-1] * model_cfg.n_layer
    kinds = sorted(set(experts))
    timed = {e: _time_one_block(_one_block_config(model_cfg, e), hf, seq_len, micro_batch, device, reps) for e in kinds}
    first = timed[kinds[0]]
    return LayerCosts(embed=first[0], blocks=tuple(timed[e][1] for e in experts), head=first[2], unit="s")


def _one_block_config(model_cfg: Any, experts: int) -> Any:
    """The config of a one-block copy whose block is dense (0), has `experts` experts, or is as configured (-1)."""
    update: dict[str, Any] = {"n_layer": 1}
    if model_cfg.moe.enabled and experts >= 0:
        update["moe"] = model_cfg.moe.model_copy(update={"experts": experts, "every": 1})
    return model_cfg.model_copy(update=update)


def _time_one_block(model_cfg: Any, hf: Any, seq_len: int, micro_batch: int, device: torch.device, reps: int) -> tuple[float, float, float]:
    lm = _build(model_cfg, hf)
    lm.weights = None  # the weights do not change the time
    materialize(lm.module, seed=0, device=device, init_spec=lm.init_spec)
    lm.after_materialize(device)
    g = torch.Generator(device=device).manual_seed(0)
    vocab, d = lm.shape.vocab_size, lm.shape.d_model
    idx = torch.randint(0, vocab, (micro_batch, seq_len), device=device, generator=g)
    h = torch.randn(micro_batch, seq_len, d, device=device, generator=g, requires_grad=True)
    view, model = lm.layers, lm.module
    block = model.get_submodule(view.blocks)[0]
    context = view.context(model, h)
    embed = median_pass_seconds(lambda: view.embed(model, idx).sum(), reps)
    one_block = median_pass_seconds(lambda: view.block(block, h, context).sum(), reps)
    head = median_pass_seconds(lambda: summed_token_loss(view.head(model, h), idx), reps)
    return embed, one_block, head


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
