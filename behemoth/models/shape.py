"""A causal LM's shape in numbers, and its FLOPs: the per-layer costs that pipeline balancing, the planner and MFU read.

`ModelShape` says what the parallel layers, the feasibility checks and the cost model need to know of
a model without building it: depth, widths, heads (query and key/value), MLP width and kind, vocabulary,
context, tied head. Every model family in `models/` describes itself this way, so nothing outside
`models/` needs to know which family it is looking at.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    """The shape of one causal LM: transformer blocks of one kind between an embedding and a head."""

    arch: str  # "gpt", "llama", "gpt2": the family, for messages only
    n_layer: int
    d_model: int
    n_head: int
    kv_heads: int  # key/value heads (grouped-query attention when fewer than n_head)
    head_dim: int
    ffn: int  # MLP width
    vocab_size: int
    context: int
    tied: bool  # the LM head reads the embedding's weight
    gated: bool  # three MLP matrices (SwiGLU) instead of two
    experts: tuple[int, ...] = ()  # experts of each block's MLP (0: a dense MLP); empty for a dense model
    top_k: int = 0  # experts each token visits in an MoE MLP

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    def block_matrix_params(self, block: int = 0) -> int:
        """Elements of a block's weight matrices one token multiplies by: q, k, v, output projection and the MLP (in an
        MoE block, the router and the k experts a token visits)."""
        attention = self.d_model * (2 * self.q_width + 2 * self.kv_width)
        mlp = (3 if self.gated else 2) * self.d_model * self.ffn
        experts = self.experts[block] if self.experts else 0
        if experts:
            mlp = self.d_model * experts + min(self.top_k, experts) * mlp
        return attention + mlp

    def tensor_parallel_sizes(self) -> dict[str, int]:
        """What a tensor-parallel degree must divide, by the option that sets it."""
        sizes = {"model.n_head": self.n_head, "hf.kv_heads": self.kv_heads, "model.d_model": self.d_model, "the MLP width": self.ffn}
        if self.kv_heads == self.n_head:
            del sizes["hf.kv_heads"]
        return sizes


@dataclass(frozen=True)
class LayerCosts:
    """Cost of one micro-batch through each part of the layered view, in any one unit."""

    embed: float
    blocks: tuple[float, ...]
    head: float  # final norm, language-model head and loss
    unit: str


def attention_flops(shape: ModelShape, seq_len: int) -> float:
    """Forward FLOPs per token of one block's attention scores and values (QK^T and AV over the whole sequence)."""
    return 4.0 * shape.q_width * seq_len


def block_forward_flops(shape: ModelShape, seq_len: int, block: int = 0) -> float:
    """Forward FLOPs per token of one block: its matrices (an MoE block's router and the experts a token visits) and attention."""
    return 2.0 * shape.block_matrix_params(block) + attention_flops(shape, seq_len)


def layer_flops(shape: ModelShape, seq_len: int) -> LayerCosts:
    """Forward FLOPs per token of the embedding, each block and the head (backward is ~2x all of them)."""
    d, v = shape.d_model, shape.vocab_size
    blocks = tuple(block_forward_flops(shape, seq_len, i) for i in range(shape.n_layer))
    return LayerCosts(embed=2.0 * d, blocks=blocks, head=2.0 * d * v + 5.0 * v, unit="flop/token")


def training_flops_per_token(shape: ModelShape, matmul_params: int, seq_len: int) -> float:
    """Model FLOPs of a training step per token, the basis of MFU: 6N over the `matmul_params` a token is multiplied by,
    plus attention forward and backward (PaLM appendix B: 12 L H Q T)."""
    return 6.0 * matmul_params + 3.0 * shape.n_layer * attention_flops(shape, seq_len)


def hardware_flops_per_token(shape: ModelShape, matmul_params: int, seq_len: int, recomputed_blocks: float = 0.0) -> float:
    """FLOPs a device really executes per token, the basis of HFU: the model FLOPs plus a forward of every recomputed
    block again (`recomputed_blocks`: how many of the n_layer blocks recompute, on average over the pipeline)."""
    return training_flops_per_token(shape, matmul_params, seq_len) + recomputed_blocks * block_forward_flops(shape, seq_len)


def uniform_layer_costs(shape: ModelShape) -> LayerCosts:
    """Every block costs 1, the embedding and head nothing: stages of equal block counts."""
    return LayerCosts(embed=0.0, blocks=(1.0,) * shape.n_layer, head=0.0, unit="blocks")


def median_pass_seconds(fn: Callable[[], torch.Tensor], reps: int) -> float:
    """Median seconds of forward + backward of `fn()` (a scalar), after one warm-up."""
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        fn().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])
