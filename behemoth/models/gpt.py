"""A GPT decoder (pre-LayerNorm) that knows nothing of parallelism.

It exposes a layered view — `embed`, `blocks`, `head` — that the pipeline partitioner cuts, a
tensor-parallel plan that names its linear layers, and the closed form of the activations one of its
blocks saves for backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from behemoth.models.gemm import linear
from behemoth.models.init import InitSpec
from behemoth.models.layered import KVCacheStep
from behemoth.models.moe import ExpertSpec, MoEConfig, MoELayer, RouterStats, StackedExperts, init_std, moe_params
from behemoth.models.shape import ModelShape

PRESETS: dict[str, dict[str, Any]] = {
    # name: shape                                                         ~parameters
    "gpt-tiny": dict(n_layer=2, n_head=2, d_model=32, context=32, vocab_size=256),  # 30K, tests
    "gpt-1m": dict(n_layer=4, n_head=4, d_model=128, context=128, vocab_size=256),  # 0.8M
    "gpt-20m": dict(n_layer=6, n_head=8, d_model=512, context=256, vocab_size=256),  # 19M
    "gpt2-124m": dict(n_layer=12, n_head=12, d_model=768, context=1024, vocab_size=50257, tie_embeddings=True),
    "gpt2-350m": dict(n_layer=24, n_head=16, d_model=1024, context=1024, vocab_size=50257, tie_embeddings=True),
    "gpt2-774m": dict(n_layer=36, n_head=20, d_model=1280, context=1024, vocab_size=50257, tie_embeddings=True),
    "gpt2-1.5b": dict(n_layer=48, n_head=25, d_model=1600, context=1024, vocab_size=50257, tie_embeddings=True),
    # mixture of experts (model.moe): an MoE MLP every `every` blocks; PR-MoE: more experts later, plus a dense residual MLP
    "gpt-moe-tiny": dict(n_layer=2, n_head=2, d_model=32, context=32, vocab_size=256, moe=dict(experts=4, every=1)),  # 50K, tests
    "gpt-moe-1m": dict(n_layer=4, n_head=4, d_model=128, context=128, vocab_size=256, moe=dict(experts=8, every=2)),  # 1.9M, 1.1M active
    "gpt-moe-20m": dict(n_layer=6, n_head=8, d_model=512, context=256, vocab_size=256, moe=dict(experts=8, every=2)),
    "pr-moe-1m": dict(n_layer=4, n_head=4, d_model=128, context=128, vocab_size=256, moe=dict(experts=[4, 8], every=2, shared_expert=True)),
}


class GPTConfig(BaseModel):
    """Shape of a GPT. `preset` fills every field the user does not set."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    preset: str = Field("gpt-1m", description=f"one of {', '.join(PRESETS)}")
    n_layer: int = Field(None, ge=1)  # type: ignore[assignment]
    n_head: int = Field(None, ge=1)  # type: ignore[assignment]
    d_model: int = Field(None, ge=1)  # type: ignore[assignment]
    context: int = Field(None, ge=2, description="longest sequence the model attends over")  # type: ignore[assignment]
    vocab_size: int = Field(None, ge=2)  # type: ignore[assignment]
    mlp_ratio: int = Field(4, ge=1)
    dropout: float | None = Field(None, ge=0, lt=1, description="default: the model's own (0 for GPT; a Hugging Face config.json's)")
    bias: bool | None = Field(None, description="biases in linear layers and norms (default: the family's own)")
    tie_embeddings: bool = False
    moe: MoEConfig = Field(default_factory=MoEConfig, description="mixture of experts (model.moe.*)")

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        preset = data.get("preset") or "gpt-1m"
        if preset not in PRESETS:
            raise ValueError(f"unknown model preset {preset!r}; choose one of {', '.join(PRESETS)}")
        given = {k: v for k, v in data.items() if v is not None}
        moe = given.get("moe")
        if isinstance(moe, BaseModel):
            moe = moe.model_dump(exclude_unset=True)
        if "moe" in PRESETS[preset] and isinstance(moe, dict):  # model.moe.top_k=1 keeps the preset's experts
            given["moe"] = {**PRESETS[preset]["moe"], **moe}
        return {**PRESETS[preset], **given}

    @model_validator(mode="after")
    def _check_heads(self) -> GPTConfig:
        if self.d_model % self.n_head:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}; pick a d_model that is a multiple of n_head"
            )
        try:
            self.moe.experts_per_block(self.n_layer)
        except Exception as err:  # a list of expert counts that does not match the MoE layers
            raise ValueError(str(err)) from None
        return self

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def has_bias(self) -> bool:
        """behemoth's GPT has biases unless `bias` is false."""
        return self.bias is not False

    @property
    def dropout_p(self) -> float:
        return self.dropout or 0.0

    def shape(self) -> ModelShape:
        return ModelShape(
            "gpt",
            self.n_layer,
            self.d_model,
            self.n_head,
            self.n_head,
            self.head_dim,
            self.mlp_ratio * self.d_model,
            self.vocab_size,
            self.context,
            self.tie_embeddings,
            gated=False,
            experts=tuple(self.moe.experts_per_block(self.n_layer)) if self.moe.enabled else (),
            top_k=self.moe.top_k if self.moe.enabled else 0,
        )

    def num_params(self, *, active: bool = False) -> int:
        """Parameters of the model; `active`: only those one token's forward uses (k experts of each MoE MLP)."""
        d, V, F = self.d_model, self.vocab_size, self.mlp_ratio * self.d_model
        b = int(self.has_bias)
        mlp = 2 * F * d + F * b + d * b
        attention = (3 * d * d + 3 * d * b) + (d * d + d * b) + 4 * d
        total = 0
        for experts in self.moe.experts_per_block(self.n_layer):
            if not experts:
                total += attention + mlp
                continue
            all_, used = moe_params(d, F, experts, self.moe.top_k)
            total += attention + (used if active else all_) + ((mlp + 2 * d + 2) if self.moe.shared_expert else 0)
        head = 0 if self.tie_embeddings else V * d
        return V * d + self.context * d + total + 2 * d + head


class CausalSelfAttention(nn.Module):
    """Causal multi-head attention over the sequence, or over a KV cache's keys and values of earlier tokens too.
    `attend` (models/attention.py) replaces the whole-sequence SDPA (context parallelism's ring or Ulysses)."""

    attend: Callable[..., torch.Tensor] | None = None

    def __init__(self, cfg: GPTConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.head_dim, self.layer_idx = cfg.head_dim, layer_idx  # layer_idx: which layer's keys and values a cache holds
        self.dropout = cfg.dropout_p
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.has_bias)  # output laid out [q | k | v]
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.has_bias)

    def forward(self, x: torch.Tensor, cache: KVCacheStep | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, -1, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)  # B, H, T, hd
        dropout = self.dropout if self.training else 0.0
        if cache is None and self.attend is not None:
            y = self.attend(q, k, v, scale=None, dropout=dropout)
        elif cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:
            k, v = cache.update(k, v, self.layer_idx)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.attention_mask, dropout_p=dropout)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=cfg.has_bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=cfg.has_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


def moe_mlp(cfg: GPTConfig, experts: int, index: int, stats: RouterStats) -> MoELayer:
    """An MoE MLP of `experts` experts as wide as the dense MLP (plus PR-MoE's dense residual MLP when asked)."""
    d, ffn = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    shared = MLP(cfg) if cfg.moe.shared_expert else None
    return MoELayer(
        ExpertSpec(experts),
        cfg.moe.policy(),
        index=index,
        stats=stats,
        router=nn.Linear(d, experts, bias=False),
        experts=StackedExperts(experts, d, ffn),
        shared=shared,
        mix=nn.Linear(d, 2) if shared is not None else None,
    )


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, moe: tuple[int, int, RouterStats] | None = None, layer_idx: int = 0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.has_bias)
        self.attn = CausalSelfAttention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.has_bias)
        self.mlp = MLP(cfg) if moe is None else moe_mlp(cfg, *moe)
        self.drop = nn.Dropout(cfg.dropout_p)

    def forward(self, x: torch.Tensor, cache: KVCacheStep | None = None) -> torch.Tensor:
        """The block over a whole sequence, or over new tokens against `cache` (cached decoding)."""
        x = x + self.drop(self.attn(self.ln_1(x), cache))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """Token + position embedding, `n_layer` blocks, final LayerNorm, language-model head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout_p)
        experts = cfg.moe.experts_per_block(cfg.n_layer)
        self.routers = RouterStats([e for e in experts if e]) if cfg.moe.enabled else None
        moe_index = {block: i for i, block in enumerate(cfg.moe.moe_blocks(cfg.n_layer))}
        self.blocks = nn.ModuleList(
            Block(cfg, (experts[i], moe_index[i], self.routers) if experts[i] else None, layer_idx=i) for i in range(cfg.n_layer)
        )
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.has_bias)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token + position embeddings; `positions` [B, T] (cached decoding) or None: 0 .. T-1."""
        pos = torch.arange(idx.shape[1], device=idx.device) if positions is None else positions
        return self.drop(self.wte(idx) + self.wpe(pos))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.project(self.ln_f(h))

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """The logits of final-norm hidden states: the LM head, or the token embedding's weight when tied."""
        return linear(h, self.wte.weight) if self.lm_head is None else self.lm_head(h)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits; `positions` [B, T]: the tokens' positions in their sequence (a context-parallel shard's), default 0 .. T-1."""
        h = self.embed(idx, positions)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def init_spec(self, name: str) -> InitSpec:
        """GPT-2 initialization: N(0, 0.02), residual projections scaled by 1/sqrt(2L)."""
        if name.endswith(".bias"):
            return InitSpec("zeros")
        if ".ln_" in f".{name}" and name.endswith(".weight"):
            return InitSpec("ones")
        moe_std = init_std(name, self.cfg.n_layer)
        if moe_std is not None:
            return InitSpec("normal", moe_std)
        if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
            return InitSpec("normal", 0.02 / math.sqrt(2 * self.cfg.n_layer))
        return InitSpec("normal", 0.02)


# behemoth's GPT as a tensor-parallel plan (parallel/tensor/plan.py). The tied head (tie_embeddings) reads
# wte.weight, which `vocab` already splits.
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


def gpt_tp_plan(cfg: GPTConfig) -> dict[str, str]:
    """The GPT plan; an MoE block's ln_2 feeds a layer computed whole on every tp rank: its experts enter the
    tensor-parallel region themselves (parallel/expert/), after the router, whose input gradient is complete on every tp
    rank (under SP the norm's output is gathered for it, `sequence_replicate`)."""
    moe = {f"blocks.{i}.ln_2": "sequence_replicate" for i in cfg.moe.moe_blocks(cfg.n_layer)}
    return {**moe, **GPT_TP_PLAN}


# behemoth's GPT as a 2-D tensor-parallel plan (parallel/tensor/twod.py): every parameter in the q x q decomposition.
GPT_TP2D_PLAN: dict[str, str] = {
    "wte": "embedding",
    "wpe": "embedding:positions",  # a [1, T] input (a context-parallel shard's global positions) is read whole by every row
    "blocks.*.ln_1": "norm",
    "blocks.*.attn.qkv": "linear:3",
    "blocks.*.attn.proj": "linear",
    "blocks.*.ln_2": "norm",
    "blocks.*.mlp.fc": "linear",
    "blocks.*.mlp.proj": "linear",
    "ln_f": "norm",
    "lm_head": "linear",
}

# 3-D (parallel.tp_mode=3d, parallel/tensor/threed.py): `linear` goes from the residual layout (features on the cube's A
# axis) to the inner one (on B), `linear-back` returns; attention and the MLP each go there and back.
GPT_TP3D_PLAN: dict[str, str] = {
    **GPT_TP2D_PLAN,
    "wpe": "embedding",
    "blocks.*.attn.proj": "linear-back",
    "blocks.*.mlp.proj": "linear-back",
}


def build_gpt(cfg: GPTConfig) -> GPT:
    """The model on the meta device: shapes only, no memory. `materialize` gives it values."""
    with torch.device("meta"):
        return GPT(cfg)
