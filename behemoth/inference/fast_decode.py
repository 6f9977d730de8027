"""The decode step of a Llama as one captured graph: every layer of a step of one new token per row, no Python per layer.

A decode step (each row adds one token) of a small model is dominated by host work, not arithmetic: the unmodified
transformers decoder layers make dozens of module calls, view and cast ops per layer. `FusedDecoder` runs the same
arithmetic as `LlamaDecoderLayer` (RMSNorm, rotary embedding, grouped-query SDPA against the paged cache, SwiGLU MLP)
from one TorchScript function (`decode_layers`, compiled once, about a second) whose loop over layers runs in
TorchScript's interpreter: per token, Python calls it once. The query/key/value projections and the gate/up
projections are fused into one matrix each, and every weight is laid out [in, out] (one token's product runs about
1.5x faster on CPU BLAS so); the model's own linear layers then view those matrices (the model keeps working as
before, its prefill included). Where oneDNN runs the products, a second copy of each matrix in oneDNN's own layout
serves steps of several tokens (`packed_layers`; only while the copies take at most `PACK_LIMIT_BYTES`). A lone
sequence's step reads its cached keys and values as a view of its consecutive slots (no gather, no mask); with `split`
(`--split-products`) a batch-1 step runs each product as two halves of the input features on two threads (CPU BLAS
runs a one-token product on one), the halves being views of the one [in, out] matrix. A packed step
(`kv_cache.PackedRows`: chunked prefill's prompt chunk and the decodes in one row) runs the same function on its one
row of T tokens under its mask, so a chunk that rides on the decodes costs what its arithmetic costs, not the layers'
host work. A step that adds the same few tokens to every row (a speculative check of K + 1 tokens, a draft catching
up: up to `runner.FUSED_MAX_NEW`, no row padded) takes the same call under a causal mask, its products by oneDNN's
matmul on CPUs (`onednn_products`: MKL's product of a few tokens by the [in, out] layout costs up to 2.3x a one-token
product, oneDNN's about 1.5x); so do a decode step of several rows and a packed step (of any size with the prepacked
copies, else of `ONEDNN_PACKED_MIN` tokens or more: `FusedDecoder.by_onednn`) (on this project's AMD CPU MKL runs
float32 products at about 200 GFLOP/s on two threads, where oneDNN, built for AVX-512, reaches 440-460: a 32-row
decode step of the 25M Llama took 22.7 ms instead of 30.5, a 32-prompt prefill 1.0 s instead of 1.6). Longer prefills,
padded batches and every model that is not a plain Llama (biases, sliding windows, quantized or tensor-parallel
layers, adapters, MoE) take the model's own blocks (`ModelRunner.hidden`).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from behemoth.inference.decode_lanes import DecodeLanes, LaneStep


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm: float32 input in torch's one fused op (the same numbers), other dtypes upcast as transformers does."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, [x.shape[-1]], weight, eps)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _half_product(x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    return F.linear(x[..., :k], w[:, :k])


@torch.jit.ignore
def _onednn_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) by oneDNN's matmul (TorchScript cannot type the op's empty scalar list: it runs in Python)."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


_onednn_product.__annotations__ = {"x": torch.Tensor, "w": torch.Tensor, "return": torch.Tensor}  # TorchScript reads types, not strings


def _product(x: torch.Tensor, w: torch.Tensor, split: bool, onednn: bool) -> torch.Tensor:
    """F.linear(x, w) of w [out, in]; w [2, in / 2, out] (`halves`): one batched product of the two halves of the input
    features, summed (torch runs the two on its two intra-op threads: CPU BLAS runs a one-token product on one); with
    `split`, the first half of the input features on a task forked onto torch's inter-op thread
    pool while this thread takes the second (CPU BLAS runs a one-token product on one thread; `w` is the [out, in] view
    of an [in, out] matrix, so each half is a contiguous block of rows: no weight is copied); with `onednn`, a product of
    a few tokens by oneDNN's matmul (`ONEDNN_PRODUCTS`), on the same view."""
    if w.dim() == 3:
        return torch.matmul(x.reshape(2, 1, w.shape[1]), w).sum(0).view(x.shape[:-1] + (w.shape[2],))
    if onednn and not split:
        return _onednn_product(x, w)
    if not split:
        return F.linear(x, w)
    k = w.shape[1] // 2
    first = torch.jit.fork(_half_product, x, w, k)
    second = F.linear(x[..., k:], w[:, k:])
    return torch.jit.wait(first) + second


def _attended(store: torch.Tensor, flat: torch.Tensor, start: int, B: int, L: int) -> torch.Tensor:
    """[B, kv_heads, L, head_dim]: the cached keys or values every row attends to; `start` >= 0: one row whose slots are
    start..start + L - 1 (a view, nothing copied), else the slots `flat` gathered with index_select (about 2.5x faster
    on CPU than advanced indexing with the [B, L] tensor)."""
    part = store.narrow(0, start, L) if start >= 0 else store.index_select(0, flat)
    return part.view(B, L, store.shape[1], store.shape[2]).transpose(1, 2)


def decode_layers(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    weights: list[list[torch.Tensor]],
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    slots: torch.Tensor,
    gather: torch.Tensor,
    mask: torch.Tensor | None,
    start: int,
    heads: int,
    kv_heads: int,
    eps: float,
    split: bool,
    onednn: bool,
    lane_keys: list[torch.Tensor],
    lane_values: list[torch.Tensor],
    lane: torch.Tensor | None,
    lane_position: torch.Tensor | None,
    lane_mask: torch.Tensor | None,
    lanes: int,
    lane_width: int,
    lanes_in_order: bool,
) -> torch.Tensor:
    """h [B, T, d] through every layer of `weights` ([norm, qkv, o, norm, gate_up, down] each); the T new tokens of
    every row (all real: no padding) written to `slots` (row by row) of `keys`/`values` ([slots, kv_heads, head_dim] per
    layer), every row attending to its `gather` slots under `mask` [B, 1, T, L] (None: every slot, for T = 1; `start`
    >= 0: the slots are start..start + L - 1); cos/sin [B, 1, T, head_dim]; `split`: every product on two threads;
    `onednn`: every product by oneDNN (`_product`). With `lane` (T = 1; decode_lanes.py): row b's new key and value
    also go to position `lane_position[b]` of its lane `lane[b]` in `lane_keys`/`lane_values` ([lanes, positions,
    kv_heads, head_dim] per layer), and it attends to lanes 0..`lanes` - 1, positions 0..`lane_width` - 1, under
    `lane_mask` instead of gathering its slots."""
    B, T, L = h.shape[0], h.shape[1], gather.shape[1]
    D = keys[0].shape[-1]
    flat = gather.reshape(-1)
    for i in range(len(weights)):
        w = weights[i]
        qkv = _product(_rms(h, w[0], eps), w[1], split, onednn).view(B, T, heads + 2 * kv_heads, D)
        qk = _rotate(qkv[:, :, : heads + kv_heads].transpose(1, 2), cos, sin)  # the queries' and keys' rotation in one
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, :, heads + kv_heads :]
        keys[i].index_copy_(0, slots, k.transpose(1, 2).reshape(B * T, kv_heads, D).to(keys[i].dtype))
        values[i].index_copy_(0, slots, v.reshape(B * T, kv_heads, D).to(values[i].dtype))
        if lane is not None and lane_position is not None:
            lk, lv = lane_keys[i], lane_values[i]
            lk.index_put_((lane, lane_position), k[:, :, 0].to(lk.dtype))
            lv.index_put_((lane, lane_position), v[:, 0].to(lv.dtype))
            k_all = lk.narrow(0, 0, lanes).narrow(1, 0, lane_width).transpose(1, 2).to(h.dtype)
            v_all = lv.narrow(0, 0, lanes).narrow(1, 0, lane_width).transpose(1, 2).to(h.dtype)
            if lanes_in_order:
                a = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=lane_mask, enable_gqa=True)
            else:
                spread = q.new_zeros(lanes, heads, 1, D).index_copy_(0, lane, q)
                a = F.scaled_dot_product_attention(spread, k_all, v_all, attn_mask=lane_mask, enable_gqa=True).index_select(0, lane)
        else:
            k_all = _attended(keys[i], flat, start, B, L).to(h.dtype)
            v_all = _attended(values[i], flat, start, B, L).to(h.dtype)
            a = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=True)
        h = h + _product(a.transpose(1, 2).reshape(B, T, heads * D), w[2], split, onednn)
        gate, up = _product(_rms(h, w[3], eps), w[4], split, onednn).chunk(2, dim=-1)
        h = h + _product(F.silu(gate) * up, w[5], split, onednn)
    return h


_SCRIPTED: dict[str, torch.jit.ScriptFunction] = {}


def scripted(fn: Any = decode_layers) -> torch.jit.ScriptFunction:
    """`fn` (`decode_layers`, or packed_prefill's `prefill_layers`) compiled by TorchScript, once per process (torch marks
    torch.jit deprecated, and it still runs)."""
    name = f"{fn.__module__}.{fn.__qualname__}"
    if name not in _SCRIPTED:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.jit.script.*is deprecated", category=DeprecationWarning)
            _SCRIPTED[name] = torch.jit.script(fn)
    return _SCRIPTED[name]


def onednn_products(h: torch.Tensor) -> bool:
    """Whether a step of several tokens per row runs its products by oneDNN's matmul: float32 on a CPU whose torch has it.
    Measured on this project's CPU (MKL, one thread, the [in, out] layout of `fuse_columns`), 2 to 6 tokens times a
    23M-parameter stack of matrices take 5.5-6 ms by oneDNN against 5.7-9 ms by F.linear (one token: 3.4-4 ms): a
    speculative check of K + 1 tokens then costs about 1.5x a decode step, not 2.3x (benchmarks/bench_speculative.py)."""
    return ONEDNN_PRODUCTS and h.device.type == "cpu" and h.dtype == torch.float32 and torch.backends.mkldnn.is_available()


ONEDNN_PRODUCTS = True  # several-token steps' products by oneDNN on CPUs (`onednn_products`); False: F.linear
ONEDNN_PACKED_MIN = 64  # a packed step (prefill, a chunk with the decodes) of fewer tokens keeps F.linear: oneDNN
# builds a kernel for every new number of rows (0.2-0.4 ms a product the first time), which a chunked-prefill step of
# 20-40 tokens, a new count at nearly every step, would pay each time; a decode step's rows (at most the batch's
# bound) and a speculative check's few tokens repeat, so their kernels are built once


def _plain_linear(m: nn.Module) -> bool:
    return type(m) is nn.Linear and m.bias is None and not (m._forward_hooks or m._forward_pre_hooks) and m.weight.is_floating_point()


def _head_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The fused decoder's untied head (bias-free): several rows' logits by oneDNN's product on CPUs (`onednn_products`;
    the head of a 32-row decode step took 0.75 ms by F.linear), one row's by F.linear."""
    if x.numel() > x.shape[-1] and onednn_products(x):
        packed = getattr(self, "packed_weight", None)
        return _onednn_product(x, self.weight if packed is None else packed)
    return F.linear(x, self.weight)


def prepack(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] reordered into oneDNN's blocked layout, once, for `_onednn_product` (an opaque tensor nothing else
    reads). Measured on this project's CPU (2 threads, the 25M Llama's 32 products): 2.2-2.3 ms at 2-8 rows against
    3.7-4.1 for the [in, out] view, 4.4-4.5 ms at 32 rows against 6.3-6.8, 50-53 at 512 against 53-55; the same
    numbers bit for bit."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_ROWS)


def packed_layers(weights: dict[int, list[torch.Tensor]]) -> dict[int, list[torch.Tensor]] | None:
    """Every layer's `layer_weights` with its four matrices `prepack`ed (norms as they are), where oneDNN runs this
    process's several-token products (`onednn_products`) and the copies take at most `PACK_LIMIT_BYTES` (they sit beside
    the [in, out] matrices, which the model's own layers and one-token steps read): None otherwise."""
    first = next(iter(weights.values()))[1]
    matrices = sum(w[i].numel() * w[i].element_size() for w in weights.values() for i in MATRICES)
    if not onednn_products(first) or matrices > PACK_LIMIT_BYTES:
        return None
    return {layer: [prepack(w) if i in MATRICES else w for i, w in enumerate(ws)] for layer, ws in weights.items()}


def warm_products(matrices: list[torch.Tensor], rows: int) -> None:
    """Build oneDNN's kernels of products by these prepacked matrices for 1..`rows` rows, once: each new row count's
    first product costs 0.3-0.4 ms more (measured here), which a chunked-prefill step of a new size would otherwise pay
    in the middle of running streams. One layer's matrices stand for all (the kernels depend on shapes, not values);
    about 0.1 s for the 25M Llama."""
    with torch.no_grad():
        for w in matrices:
            x = torch.zeros(rows, w.shape[1], dtype=torch.float32)
            for m in range(1, rows + 1):
                _onednn_product(x[:m], w)


MATRICES = (1, 2, 4, 5)  # the products' matrices in a layer's `layer_weights` (the others are norms)
PACK_ROWS = 32  # the rows oneDNN's layout is chosen for (a full decode step of the default batch bound)
PACK_LIMIT_BYTES = 2 << 30  # larger models keep one copy of their weights (their products read the [in, out] views)


def fusable(block: Any) -> bool:
    """A transformers LlamaDecoderLayer with plain bias-free linear layers and a SiLU MLP (what `decode_layers` computes)."""
    if type(block).__name__ != "LlamaDecoderLayer" or type(block.mlp).__name__ != "LlamaMLP":
        return False
    attn, mlp = block.self_attn, block.mlp
    config = attn.config
    if getattr(config, "hidden_act", None) != "silu" or getattr(config, "sliding_window", None) is not None:
        return False
    if abs(attn.scaling - attn.head_dim**-0.5) > 1e-12:
        return False
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return all(_plain_linear(m) for m in linears)


def fuse_columns(linears: Sequence[Any]) -> torch.Tensor:
    """One [in, sum of outs] matrix, contiguous, holding the layers' weights transposed; each layer's weight becomes a
    view of its columns (a weight laid out [in, out] multiplies one token about 1.5x faster on CPU BLAS than [out, in]).
    Returned as the [sum of outs, in] view F.linear takes."""
    fused = torch.cat([m.weight.detach().t() for m in linears], dim=1).contiguous()
    start = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(fused[:, start : start + rows].t(), requires_grad=m.weight.requires_grad)
        start += rows
    return fused.t()


def layer_weights(block: Any) -> list[torch.Tensor]:
    """[input norm, fused qkv, o, post-attention norm, fused gate/up, down] of one decoder layer."""
    attn, mlp = block.self_attn, block.mlp
    qkv = fuse_columns([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up = fuse_columns([mlp.gate_proj, mlp.up_proj])
    o, down = fuse_columns([attn.o_proj]), fuse_columns([mlp.down_proj])
    return [block.input_layernorm.weight, qkv, o, block.post_attention_layernorm.weight, gate_up, down]


def halves(weights: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """A layer's `layer_weights` with each product's matrix as [2, in / 2, out] (views of its two halves of the input
    features, nothing copied): `_product`'s batched two-thread form. None where a product has an odd number of inputs."""
    if any(weights[i].shape[1] % 2 for i in MATRICES):
        return None
    return [w.t().view(2, w.shape[1] // 2, w.shape[0]) if i in MATRICES else w for i, w in enumerate(weights)]


def contiguous_start(gather: torch.Tensor) -> int:
    """The first slot where the step has one row attending to consecutive slots (a lone sequence's blocks are handed out
    in order), else -1."""
    if gather.shape[0] != 1:
        return -1
    first = int(gather[0, 0])
    return first if torch.equal(gather[0], torch.arange(first, first + gather.shape[1], device=gather.device)) else -1


class FusedDecoder:
    """The decode step of a run of Llama decoder layers as one TorchScript call."""

    def __init__(self, blocks: nn.ModuleList, layers: Sequence[int], head: Any = None, split: bool = False) -> None:
        first: Any = blocks[layers[0]]
        config = first.self_attn.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.eps = float(first.input_layernorm.variance_epsilon)
        self.weights = {i: layer_weights(blocks[i]) for i in layers}
        self.packed = packed_layers(self.weights)  # oneDNN's own layout of the products' matrices, where it is kept
        if self.packed is not None:
            warm_products([self.packed[layers[0]][i] for i in MATRICES], ONEDNN_PACKED_MIN)
        split_weights = {i: halves(w) for i, w in self.weights.items()}
        self.halves = None if any(w is None for w in split_weights.values()) else split_weights
        if head is not None and _plain_linear(head):
            fuse_columns([head])  # the head's own forward then reads its weight laid out [in, out] too
            head.packed_weight = prepack(head.weight) if self.packed is not None else None
            if head.packed_weight is not None:
                warm_products([head.packed_weight], ONEDNN_PACKED_MIN)
            head.forward = types.MethodType(_head_forward, head)
        self.run = scripted()
        self.split = split  # batch-1 steps split every product over two threads (`_product`)
        self.use_lanes = True  # decode steps attend to dense per-request lanes, not a gather of the cache (decode_lanes.py)
        self.lanes: DecodeLanes | None = None

    @staticmethod
    def of(blocks: nn.ModuleList, layers: Sequence[int], head: nn.Module | None = None, split: bool = False) -> FusedDecoder | None:
        """The fused decoder of `layers` (and an untied `head` laid out for one-token products), or None where one of
        the layers is not a plain Llama layer; `split`: batch-1 steps run each product on two threads."""
        if not layers or not all(fusable(blocks[i]) for i in layers):
            return None
        return FusedDecoder(blocks, layers, head, split)

    def __call__(self, h: torch.Tensor, ctx: dict, layers: Sequence[int], storage: object) -> torch.Tensor:
        """Every layer of `layers` on h [B, T, d] of a step whose rows all add T tokens (`ctx`: the view's context, with
        its cache step): a decode step (T = 1), a few tokens per row (a speculative check, a draft catching up), or the
        one row of a packed step (chunked prefill's chunk and the decodes, under the packed mask)."""
        cos, sin = ctx["position_embeddings"]
        step = ctx["cache"]
        keys, values = storage.keys, storage.values  # type: ignore[attr-defined]
        packed = step.batch.packed is not None
        start = -1 if packed else contiguous_start(step.batch.gather)  # a packed row always needs its mask
        rows, new = h.shape[0], h.shape[1]
        lanes = self.lane_step(step.batch, storage, layers, h.dtype) if new == 1 and not packed and start < 0 else None
        onednn = self.by_onednn(h, rows * new, packed)
        split = self.split and rows == 1  # `_product` then splits a product over two threads, by F.linear
        return self.run(
            h,
            cos.unsqueeze(1),
            sin.unsqueeze(1),
            [self.layer_weights(i, rows * new, onednn and not split) for i in layers],
            [keys[i] for i in layers],
            [values[i] for i in layers],
            step.batch.slots,
            step.batch.gather,
            None if start >= 0 and new == 1 else ctx["attention_mask"],
            start,
            self.heads,
            self.kv_heads,
            self.eps,
            split,
            onednn,
            [self.lanes.keys[i] for i in layers] if lanes is not None and self.lanes is not None else [],
            [self.lanes.values[i] for i in layers] if lanes is not None and self.lanes is not None else [],
            None if lanes is None else lanes.lane,
            None if lanes is None else lanes.position,
            None if lanes is None else lanes.mask,
            0 if lanes is None else lanes.lanes,
            0 if lanes is None else lanes.positions,
            lanes is not None and lanes.in_order,
        )

    def lane_step(self, batch: Any, storage: Any, layers: Sequence[int], dtype: torch.dtype) -> LaneStep | None:
        """The decode lanes of a decode step whose rows' owners are known (decode_lanes.py), built at first use over
        `layers` within the paged cache's own bytes; None where lanes are off, or the step's rows do not fit them."""
        if not self.use_lanes or batch.owners is None:
            return None
        if self.lanes is None:
            layout = storage.layout
            self.lanes = DecodeLanes(list(layers), layout.kv_heads, layout.head_dim, layout.bytes, dtype, storage.device)
        if list(layers) != self.lanes.layers:
            return None
        return self.lanes.plan(batch.owners, batch.gather, batch.positions[:, 0], storage)

    def by_onednn(self, h: torch.Tensor, tokens: int, packed: bool) -> bool:
        """Whether a step of `tokens` new tokens in all runs its products by oneDNN: on CPUs in float32 (`onednn_products`),
        a step of several tokens; with the matrices prepacked (`packed_layers`, whose kernels for up to
        `ONEDNN_PACKED_MIN` rows are built at start) a packed step of any size, without them one of `ONEDNN_PACKED_MIN`
        tokens or more (each new row count builds a kernel the first time)."""
        if not onednn_products(h):
            return False
        if tokens == 1:  # a lone token keeps BLAS (its two batched halves): the prepacked product was no faster
            return False
        return self.packed is not None or not packed or tokens >= ONEDNN_PACKED_MIN

    def layer_weights(self, layer: int, tokens: int, onednn: bool = False) -> list[torch.Tensor]:
        """Layer `layer`'s weights for a step of `tokens` new tokens in all: with `onednn` (every product by oneDNN), its
        matrices in oneDNN's layout where they are kept (`packed_layers`); a lone token's products as two batched halves
        (`halves`) where torch has two intra-op threads to run them and `split` does not fork them instead."""
        if onednn and self.packed is not None:
            return self.packed[layer]
        if tokens == 1 and self.halves is not None and not self.split and torch.get_num_threads() >= 2:
            return cast(list[torch.Tensor], self.halves[layer])
        return self.weights[layer]
