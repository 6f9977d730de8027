"""Activation memory of behemoth's GPT under tensor and sequence parallelism, in closed form (parallel/tensor/
activations.py measures what autograd really saves, and the tests compare the two).

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") count, per
transformer layer in bytes with 16-bit activations and 1-byte dropout masks,

    no parallelism   sbh (34 + 5as/h)
    tensor parallel  sbh (10 + 24/t + 5as/(ht))
    TP + sequence    sbh/t (34 + 5as/h)

(s sequence, b micro-batch, h hidden, a heads). behemoth's GPT block differs: float32 (4 bytes), no dropout
masks at dropout 0, and PyTorch's fused (flash) attention keeps q, k, v, its output and a log-sum-exp per
row and head instead of the a s^2 b score and softmax tensors. Counted in elements:

    LayerNorm inputs 2, qkv input 1, qkv output (q, k, v) 3, attention output = proj input 1 (the fused
    kernel returns it in [b, s, a, h/a] layout, so the reshape is a view), fc input 1,
    fc output (GELU input) 4, GELU output (proj input) 4                       = 16 sbh
    LayerNorm mean and rstd 2 x 2 bs, log-sum-exp a bs

so 4 (16 sbh + 4 bs + a bs) bytes = sbh (64 + 16/h + 4a/h): Megatron's 16 elements of sbh without the two
dropout masks and with the attention output in place of the 5as/h score terms. Under TP the LayerNorm
inputs, the qkv and fc inputs and the LayerNorm statistics (4 sbh + 4 bs) stay whole on every rank and the
rest is split (12 sbh + a bs over t), the analogue of Megatron's 10 + 24/t: sbh (16 + 48/t + ...). Under
TP + SP everything is split and the whole block divides by t, as in Megatron's third line, because the column
layers keep only the sequence shard of their input and gather it again in backward (layers.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from behemoth.models.gpt import GPTConfig
from behemoth.models.shape import ModelShape


def gpt_block_activation_bytes(
    *, b: int, s: int, h: int, a: int, t: int = 1, sp: bool = False, mlp_ratio: int = 4, dtype: torch.dtype = torch.float32
) -> float:
    """Bytes one rank saves for backward in one behemoth GPT block (dropout 0, fused attention), per the module docstring."""
    split = (3 + 1 + 2 * mlp_ratio) * s * b * h + a * b * s  # qkv output, attention output (= proj input), MLP; log-sum-exp
    whole = 4 * s * b * h + 4 * b * s  # LayerNorm inputs, qkv and fc inputs; LayerNorm statistics
    elements = (split + whole) / t if sp else split / t + whole
    return elements * dtype.itemsize


def gpt_activation_bytes(cfg: GPTConfig, *, b: int, s: int, t: int = 1, sp: bool = False) -> float:
    """Bytes the rank with the most vocabulary rows saves in a float32 forward of the whole GPT and its loss: the
    blocks, the embedding (token ids, positions; under TP local ids and a vocabulary mask), the final LayerNorm
    and head inputs (a tied head, F.linear on the embedding weight, keeps the gathered input) and the loss
    (softmax over this rank's vocabulary columns, targets)."""
    h, sp = cfg.d_model, sp and t > 1
    blocks = cfg.n_layer * gpt_block_activation_bytes(b=b, s=s, h=h, a=cfg.n_head, t=t, sp=sp, mlp_ratio=cfg.mlp_ratio)
    seq = t if sp else 1
    embed = 8 * b * s + 8 * s + (b * s if t > 1 else 0)
    head = 4 * (s * b * h + 2 * b * s) / seq + 4 * s * b * h / (1 if cfg.tie_embeddings else seq)
    loss = 4 * b * s * cfg.vocab_size + 8 * b * s + 4 if t == 1 else 4 * b * s * math.ceil(cfg.vocab_size / t) + 9 * b * s
    return blocks + embed + head + loss


@dataclass(frozen=True)
class BlockActivations:
    """Elements one block of a model family saves for backward, per token, in a forward at dropout 0 (fused attention).

    `whole` stays whole on every tensor-parallel rank (norm inputs and statistics, the inputs of column-parallel layers)
    and divides by t under sequence parallelism; `split` divides by t (the tensor-parallel region: q, k, v, attention
    output, the MLP's hidden activations, the log-sum-exp per head); `shared` is the same on every rank whatever the
    layout (Llama's rotary cos and sin, one head's width per position); `per_block` does not grow with the tokens
    (Gemma's (1 + w) norm weights, made anew in each forward)."""

    whole: float
    split: float
    shared: float = 0.0
    per_block: float = 0.0

    def per_token(self, t: int = 1, sp: bool = False) -> float:
        """Elements per token on one tensor-parallel rank of degree t (sequence parallelism: `sp`)."""
        return (self.whole + self.split) / t + self.shared if sp and t > 1 else self.whole + self.split / t + self.shared

    def elements(self, tokens: int, t: int = 1, sp: bool = False) -> float:
        """Elements one block saves for `tokens` tokens on one tensor-parallel rank."""
        return self.per_token(t, sp) * tokens + self.per_block


STANDARD_LAYOUT = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "mixtral")  # models/hf_families.py's families


def block_activation_elements(shape: ModelShape) -> BlockActivations:
    """Per-token saved elements of one block of `shape`'s family (fitted to autograd's saved tensors, exactly, over
    widths, heads, KV heads and MLP widths; tests/test_planner.py traces them):

        gpt     LayerNorm inputs 2h + stats 4, qkv and fc inputs 2h; q, k, v, attention output, GELU in and out, heads
        gpt2    the same, with transformers' tanh GELU keeping 5 MLP-width tensors instead of 2
        llama   RMSNorm input and normalized input 2h + 1 each, q/k/v and MLP inputs 2h; q, k after and before rotary,
                v, the log-sum-exp per head; SwiGLU's gate, up, SiLU and product; rotary cos/sin (head_dim).
                Mistral and Qwen2 save the same (a sliding window and q/k/v biases add nothing)
        qwen3   Llama's, and its per-head q and k RMSNorms: input, normalized and a statistic per head, 2q + 2kv + heads
                + kv heads
        gemma   Llama's, and per block the (1 + w) weights of its two norms, 2h whatever the tokens
        phi3    Llama's, and 2q + kv more from its fused qkv projection, whose slices keep the fused output alive
    The MoE MLP of Mixtral is counted as Llama's dense one (its experts' saved tensors depend on the routing).
    """
    h, q, kv, ffn, heads = shape.d_model, shape.q_width, shape.kv_width, shape.ffn, shape.n_head
    if shape.arch in STANDARD_LAYOUT:
        split = 2 * q + 2 * kv + heads + 4 * ffn
        split += {"qwen3": 2 * q + 2 * kv + heads + shape.kv_heads, "phi3": 2 * q + kv}.get(shape.arch, 0)
        return BlockActivations(whole=6 * h + 2, split=split, shared=shape.head_dim, per_block=2 * h if shape.arch == "gemma" else 0)
    hidden = 5 if shape.arch == "gpt2" else 2
    return BlockActivations(whole=4 * h + 4, split=2 * q + 2 * kv + heads + hidden * ffn)


QKV_INPUT = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj"})  # linears that read the attention norm's output
MLP_INPUT = frozenset({"gate_proj", "up_proj", "gate_up_proj"})  # linears that read the MLP norm's output


def lora_block_activations(base: BlockActivations, shape: ModelShape, rank: int, adapted: frozenset[str]) -> BlockActivations:
    """`base` for a block whose weights are frozen and whose linears `adapted` (their module names) carry rank-`rank`
    adapters (traced exactly in tests/test_planner.py). A frozen weight needs no saved input for its gradient, so in
    the standard layout the norms' normalized inputs go (2h; Qwen3's q/k norms q + kv more), the attention norm's output
    stays only if a q/k/v projection is adapted (its A reads it), the MLP norm's output only if gate or up is, and the
    down projection's input only if it is; each adapter keeps its A output (r per token). Other families: `base` plus
    the A outputs."""
    shared = base.shared + rank * len(adapted)
    if shape.arch not in STANDARD_LAYOUT:
        return BlockActivations(base.whole, base.split, shared, base.per_block)
    h = shape.d_model
    whole = base.whole - 2 * h - (0 if adapted & QKV_INPUT else h) - (0 if adapted & MLP_INPUT else h)
    split = base.split - (0 if "down_proj" in adapted else shape.ffn) - (shape.q_width + shape.kv_width if shape.arch == "qwen3" else 0)
    return BlockActivations(whole, split, shared, base.per_block)
