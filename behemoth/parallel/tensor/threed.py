"""3-D tensor parallelism applied to a model: its linear layers as cube products, its embeddings, norms and loss in the
same q x q x q decomposition (cube.py has the cube and the products).

The residual stream's activations [batch, T, h] on rank (t, a, b) are sequence block t*q + b of the micro-batch's q^2
(whole sequences) x A's block a of the features: 1/q^3 of it. Styles of a 3-D plan (module-name pattern -> style):
    linear       nn.Linear from the residual layout (features on A) to the inner one (features on B, sequences
                 t*q + a): weight block (A's inputs, B's outputs), cut in q along its inputs by t; bias: B's block,
                 cut in q^2 over the plane at b
    linear:K     the same for K fused equal output segments (a fused [q|k|v]: B's block holds whole heads of each)
    linear-back  nn.Linear from the inner layout back to the residual one (B -> A)
    embedding    nn.Embedding, its features A's block cut in q^2 over the plane at a, gathered before the lookup; a
                 [batch, T] input keeps sequence block t*q + b, a [T] input (positions) all
    norm         nn.LayerNorm (or a Llama-kind RMSNorm) on the residual layout: mean and variance (mean square) summed
                 along A, weight and bias as vectors
    norm:offset  an RMSNorm that scales by 1 + w (Gemma's)
    replicated   a module run on local features whose parameters every rank holds whole (Qwen3's per-head q/k norms on
                 B's whole heads): each rank's gradient covers its heads and sequences, so it is summed over the cube
Attention needs no communication: B's qkv block holds whole heads of whole sequences. The loss: the head (a `linear`)
leaves rank (t, a, b) the logits of sequence block t*q + a x B's vocabulary block, so the cross-entropy is
vocabulary-parallel along B and the sums are all-reduced over the plane at b (the q^2 sequence blocks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from behemoth.comm import reduce_flat
from behemoth.errors import BehemothError
from behemoth.models.init import FULL_NAME
from behemoth.parallel.chunked import checkpoint_views
from behemoth.parallel.tensor.comm import reduce_from_tp
from behemoth.parallel.tensor.cube import Grid3D, cube_linear, gather_plane, other
from behemoth.parallel.tensor.layers import TP_LAYOUT, VocabShard, shard_parameter, vocab_parallel_cross_entropy
from behemoth.parallel.tensor.plan import match_plan
from behemoth.parallel.tensor.summa import BlockLayout, Grid2D, even, packed, sub
from behemoth.parallel.tensor.twod import _LayerNorm2D, keep_whole, norm_spec

STYLES_3D = ("linear", "linear-back", "embedding", "norm", "replicated")


def vector_pieces(n: int, grid: Grid3D, axis: str, name: str, parts: int = 1) -> BlockLayout:
    """A vector's 1/q^3 piece: `axis`'s block of [0, n) (`parts` fused segments), cut in q^2 over the plane there."""
    block = packed(n, parts, grid.q, grid.coord(axis), name)
    return BlockLayout.of((n,), d0=sub(block, grid.q * grid.q, grid.plane_index(axis), name))


def sequence_block(t: torch.Tensor, grid: Grid3D, feature_axis: str) -> torch.Tensor:
    """The micro-batch's sequence block that an activation with features on `feature_axis` holds (of q^2)."""
    parts = grid.q * grid.q
    if t.shape[0] % parts:
        raise BehemothError(
            f"3-D tensor parallelism splits each micro-batch's {t.shape[0]} sequences in q^2={parts} blocks",
            f"use a micro-batch (train.micro_batch) that is a multiple of {parts}",
        )
    return t.chunk(parts, 0)[grid.batch_index(feature_axis)]


class Linear3D(nn.Module):
    """Y = X W + b on the cube: input features on `i_axis`, output features on the other axis."""

    chunkable = False  # a head computed across ranks: the chunked loss leaves it alone

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, grid: Grid3D, i_axis: str) -> None:
        super().__init__()
        self.weight, self.bias, self.grid, self.i_axis, self.o_axis = weight, bias, grid, i_axis, other(i_axis)

    @classmethod
    def from_module(cls, module: nn.Module, name: str, grid: Grid3D, i_axis: str, parts: int = 1) -> Linear3D:
        if not isinstance(module, nn.Linear):
            raise BehemothError(f"{name} is a {type(module).__name__}; the 3-D linear style applies to nn.Linear", "map it to another 3-D style")
        out, inp = module.weight.shape
        o_axis = other(i_axis)
        cols = packed(out, parts, grid.q, grid.coord(o_axis), f"{name}.weight")
        rows = sub(even(inp, grid.q, grid.coord(i_axis), f"{name}.weight"), grid.q, grid.coords[0], f"{name}.weight")
        weight = shard_parameter(module.weight, f"{name}.weight", BlockLayout.of((out, inp), d0=cols, d1=rows))  # type: ignore[arg-type]
        bias = None
        if module.bias is not None:
            bias = shard_parameter(module.bias, f"{name}.bias", vector_pieces(out, grid, o_axis, f"{name}.bias", parts))
        return cls(weight, bias, grid, i_axis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = cube_linear(x.reshape(-1, x.shape[-1]), self.weight, self.grid, self.i_axis, self.o_axis)
        if self.bias is not None:
            y = y + gather_plane(self.bias, self.grid, self.o_axis)
        return y.view(*x.shape[:-1], y.shape[-1])


class Embedding3D(nn.Module):
    """A lookup into A's feature block of the table (gathered over the plane at a); the output is residual-layout."""

    def __init__(self, weight: nn.Parameter, grid: Grid3D, padding_idx: int | None) -> None:
        super().__init__()
        self.weight, self.grid, self.padding_idx = weight, grid, padding_idx

    @classmethod
    def from_module(cls, module: nn.Module, name: str, grid: Grid3D) -> Embedding3D:
        if not isinstance(module, nn.Embedding):
            raise BehemothError(f"{name} is a {type(module).__name__}; the 3-D embedding style applies to nn.Embedding", "map it to another style")
        rows, width = module.weight.shape
        layout = BlockLayout.of((rows, width), d1=vector_pieces(width, grid, "a", f"{name}.weight").dims[0])
        return cls(shard_parameter(module.weight, f"{name}.weight", layout), grid, module.padding_idx)  # type: ignore[arg-type]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = sequence_block(ids, self.grid, "a") if ids.dim() == 2 else ids
        return F.embedding(ids, gather_plane(self.weight, self.grid, "a"), padding_idx=self.padding_idx)


class LayerNorm3D(nn.Module):
    """LayerNorm (or a Llama-kind RMSNorm: `rms`) of the residual layout: mean and variance (mean square) from sums
    along A (2-D's norm with A as its row); weight and bias gathered over the plane at a."""

    def __init__(
        self, weight: nn.Parameter | None, bias: nn.Parameter | None, width: int, eps: float, grid: Grid3D, rms: bool = False, offset: bool = False
    ) -> None:
        super().__init__()
        self.weight, self.bias, self.width, self.eps, self.grid, self.rms = weight, bias, width, eps, grid, rms
        self.offset = offset  # scales by 1 + w (Gemma)
        self.sums = Grid2D(grid.q, grid.coord("a"), 0, grid.lines.get("a"), None, grid.meter)  # only its row is used

    @classmethod
    def from_module(cls, module: nn.Module, name: str, grid: Grid3D, offset: bool = False) -> LayerNorm3D:
        width, eps, rms = norm_spec(module, name, "3-D", offset)
        weight, bias = (
            shard_parameter(p, f"{name}.{n}", vector_pieces(width, grid, "a", f"{name}.{n}")) if isinstance(p, nn.Parameter) else None
            for n, p in (("weight", module.weight), ("bias", getattr(module, "bias", None)))
        )
        return cls(weight, bias, width, eps, grid, rms, offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = gather_plane(self.weight, self.grid, "a") if self.weight is not None else None
        weight = 1 + weight if self.offset and weight is not None else weight
        bias = gather_plane(self.bias, self.grid, "a") if self.bias is not None else None
        return _LayerNorm2D.apply(x, weight, bias, (self.width, self.eps, self.sums, self.rms))


class TensorParallel3D:
    """What applying a 3-D plan leaves behind (the interface of plan.TensorParallel): no gradient is partial (each
    piece gets its whole gradient from the cube's reduce-scatters) and no two tp ranks hold the same piece, but the
    replicated parameters, which every rank holds whole."""

    sequence_parallel = False

    def __init__(self, model: nn.Module, grid: Grid3D, vocab: VocabShard | None, replicated: frozenset[str] = frozenset()) -> None:
        self.grid, self.vocab = grid, vocab
        named = list(model.named_parameters(remove_duplicate=False))
        self.layouts = {n: getattr(p, TP_LAYOUT) for n, p in named if hasattr(p, TP_LAYOUT)}
        self.split_layouts = {getattr(p, FULL_NAME, n): layout for n, p in named if (layout := getattr(p, TP_LAYOUT, None)) is not None}
        self.replicated = replicated | {getattr(p, FULL_NAME, n) for n, p in named if n in replicated}  # whole on every rank

    @torch.no_grad()
    def finish_grads(self, slices: list[tuple[str, torch.Tensor]]) -> None:
        """Nothing to sum but the replicated parameters' (over the plane at a, then along A: the whole cube); every other
        gradient already is this rank's piece's whole gradient."""
        whole = [g for name, g in slices if name in self.replicated]
        if whole:
            reduce_flat(whole, self.grid.plane_comm("a").all_reduce)
            reduce_flat(whole, self.grid.line_comm("a").all_reduce)

    def copies(self, name: str) -> int:
        """Ranks of the tp group holding this parameter's piece: one (every rank: replicated)."""
        return self.grid.q**3 if name in self.replicated else 1

    def activation_block(self, hidden_size: int) -> tuple[int, int]:
        """(hidden features, sequence blocks) of this rank's piece of a residual activation: A's feature block of
        sequence block t*q + b of q^2; what pipeline stages exchange."""
        return hidden_size // self.grid.q, self.grid.q * self.grid.q

    def cross_entropy_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The micro-batch's summed token loss on every rank, from sequence block t*q + a x B's vocabulary logits."""
        if self.vocab is None or logits.shape[-1] != self.vocab.padded:
            raise BehemothError("3-D tensor parallelism needs the LM head in its plan (a vocabulary block per B)", "map lm_head to linear")
        mine = sequence_block(targets, self.grid, "b")
        per_token = vocab_parallel_cross_entropy(logits, mine, self.vocab, self.grid.line_comm("b"))
        return reduce_from_tp(per_token.sum(), self.grid.plane_comm("b"))

    def checkpoint_views(self, state: dict[str, Any]) -> dict[str, Any]:
        """Pieces as full-shape views under single-process names, so DCP reshards to any layout."""
        return checkpoint_views(state, self.layouts)


def apply_tensor_parallel_3d(model: nn.Module, grid: Grid3D, plan: dict[str, str]) -> TensorParallel3D:
    """Replace the modules `plan` names by their 3-D versions (on the meta device or not); refuse a plan that leaves a
    parameter whole (a tied head: its one table would need two layouts)."""
    styles = match_plan(plan, [n for n, _ in model.named_modules() if n], STYLES_3D)
    replicated: set[str] = set()
    for name, style in styles.items():
        module = model.get_submodule(name)
        kind, _, arg = style.partition(":")
        new: nn.Module
        if kind == "replicated":
            replicated |= keep_whole(module, name)
            continue
        if kind in ("linear", "linear-back"):
            new = Linear3D.from_module(module, name, grid, "a" if kind == "linear" else "b", int(arg or 1))
        elif kind == "embedding":
            new = Embedding3D.from_module(module, name, grid)
        else:
            new = LayerNorm3D.from_module(module, name, grid, offset=arg == "offset")
        model.set_submodule(name, new)
    whole = [n for n, p in model.named_parameters(remove_duplicate=False) if not hasattr(p, TP_LAYOUT)]
    if whole:
        raise BehemothError(f"3-D tensor parallelism: {', '.join(whole[:3])} is not split by the 3-D plan (a tied head?)", "untie the head or map it")
    vocab = None
    if "lm_head" in styles:
        v = int(model.get_submodule("lm_head").weight.shape[0])  # type: ignore[index]  # a Linear3D's block
        vocab = VocabShard(grid.coord("b") * v, v, v)
    return TensorParallel3D(model, grid, vocab, frozenset(replicated))
