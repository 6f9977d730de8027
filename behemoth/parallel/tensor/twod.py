"""2-D tensor parallelism applied to a model: its linear layers as SUMMA products, its embeddings, norms and loss in
the same q x q decomposition (summa.py has the grid and the products).

Styles of a 2-D plan (module-name pattern -> style, as for 1-D plans):
    linear       nn.Linear as a SUMMA product: weight block (i, j) = inputs of row i x outputs of column j; its bias
                 column j's block, cut in q by row i
    linear:K     the same for K fused equal output segments (a fused [q|k|v]): column j holds whole heads of each
                 (either on an nn.Linear or on a transposed Conv1D, GPT-2's [in, out] weight, blocked the same way)
    embedding    nn.Embedding with its features cut in q^2 (column j's block, cut by row i), all-gathered along the
                 column before the lookup; a [batch, T] input keeps grid row i's sequences, a [T] input (positions) all
    embedding:positions  the same for a position table: a [1, T] input (positions shared by the batch) is kept whole
    norm         nn.LayerNorm (or a Llama-kind RMSNorm) on feature blocks: mean and variance (mean square) summed along
                 the row, weight and bias as vectors
    norm:offset  an RMSNorm that scales by 1 + w (Gemma's, its epsilon `eps`)
    replicated   a module run on local features whose parameters every rank holds whole (Qwen3's per-head q/k norms,
                 one head_dim vector for every head): each rank's gradient covers its heads and sequences, so it is summed
                 over the row and the column (the whole grid)
Every parameter must be named by the plan: activations are blocks [batch/q, T, h/q], which no replicated module reads.
A `linear` head whose weight is an `embedding`'s table (a tied head, GPT-2's) becomes `TiedHead2D`, on the table's layout.

The loss: the head's logits on rank (i, j) are row i's sequences x column j's vocabulary block, so the cross-entropy is
vocabulary-parallel along the row (layers.py's, two small all-reduces per token) and the rows' sums are all-reduced
along the column (identity backward), so every rank holds the micro-batch's summed loss, as under 1-D TP.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from behemoth.comm import CommMeter, all_gather, all_reduce, reduce_flat, reduce_scatter
from behemoth.errors import BehemothError
from behemoth.models import gemm
from behemoth.models.init import FULL_NAME
from behemoth.parallel.chunked import checkpoint_views
from behemoth.parallel.tensor.comm import reduce_from_tp
from behemoth.parallel.tensor.layers import TP_LAYOUT, VocabShard, shard_parameter, vocab_parallel_cross_entropy
from behemoth.parallel.tensor.plan import match_plan
from behemoth.parallel.tensor.summa import BlockLayout, Grid2D, even, gather_column, packed, sub, summa_linear

STYLES_2D = ("linear", "embedding", "norm", "replicated")


def vector_pieces(n: int, grid: Grid2D, name: str) -> BlockLayout:
    """A vector's 1/q^2 piece on this rank: column j's block of [0, n), cut in q by row i."""
    return BlockLayout.of((n,), d0=sub(even(n, grid.q, grid.col, name), grid.q, grid.row, name))


def batch_block(t: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """Grid row i's sequences of a [batch, ...] tensor (of this rank's layer's share under 2.5-D)."""
    parts = grid.batch_blocks
    if t.shape[0] % parts:
        raise BehemothError(
            f"2-D tensor parallelism splits each micro-batch's {t.shape[0]} sequences over {parts} grid rows",
            f"use a micro-batch (train.micro_batch) that is a multiple of {parts}",
        )
    return t.chunk(parts, 0)[grid.batch_index]


class Linear2D(nn.Module):
    """Y_ij = X W + b on the grid (SUMMA): input [..., in/q] of row i's tokens, output [..., out/q] of column j."""

    chunkable = False  # a head computed across ranks: the chunked loss (models/chunked_loss.py) leaves it alone

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, grid: Grid2D) -> None:
        super().__init__()
        self.weight, self.bias, self.grid = weight, bias, grid

    @classmethod
    def from_module(cls, module: nn.Module, name: str, grid: Grid2D, parts: int = 1) -> Linear2D:
        transposed = type(module).__name__ == "Conv1D" and hasattr(module, "nf")  # transformers' Conv1D: weight [in, out]
        if not isinstance(module, nn.Linear) and not transposed:
            raise BehemothError(f"{name} is a {type(module).__name__}; the 2-D linear style applies to nn.Linear", "map it to another 2-D style")
        n0, n1 = (int(n) for n in module.weight.shape)  # type: ignore[union-attr]
        out, inp = (n1, n0) if transposed else (n0, n1)
        cols = packed(out, parts, grid.q, grid.col, f"{name}.weight")
        rows = even(inp, grid.q, grid.row, f"{name}.weight")
        layout = BlockLayout.of((inp, out), d0=rows, d1=cols) if transposed else BlockLayout.of((out, inp), d0=cols, d1=rows)
        weight = shard_parameter(module.weight, f"{name}.weight", layout)  # type: ignore[arg-type]
        bias = None
        if module.bias is not None:
            bias = shard_parameter(module.bias, f"{name}.bias", BlockLayout.of((out,), d0=sub(cols, grid.q, grid.row, f"{name}.bias")))  # type: ignore[arg-type]
        new = cls(weight, bias, grid)
        new.transposed = transposed
        return new

    transposed = False  # the weight is stored [in, out] (a Conv1D's)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = summa_linear(x.reshape(-1, x.shape[-1]), self.weight.t() if self.transposed else self.weight, self.grid)
        if self.bias is not None:
            y = y + gather_column(self.bias, self.grid)
        return y.view(*x.shape[:-1], y.shape[-1])


class Embedding2D(nn.Module):
    """A lookup into column j's feature block of the table (all-gathered from the column's q pieces)."""

    def __init__(self, weight: nn.Parameter, grid: Grid2D, padding_idx: int | None, positions: bool = False) -> None:
        super().__init__()
        self.weight, self.grid, self.padding_idx = weight, grid, padding_idx
        self.positions = positions  # a position table: a [1, T] input is shared by every sequence, kept whole

    @classmethod
    def from_module(cls, module: nn.Module, name: str, grid: Grid2D, positions: bool = False) -> Embedding2D:
        if not isinstance(module, nn.Embedding):
            raise BehemothError(f"{name} is a {type(module).__name__}; the 2-D embedding style applies to nn.Embedding", "map it to another style")
        rows, width = module.weight.shape
        layout = BlockLayout.of((rows, width), d1=vector_pieces(width, grid, f"{name}.weight").dims[0])
        return cls(shard_parameter(module.weight, f"{name}.weight", layout), grid, module.padding_idx, positions)  # type: ignore[arg-type]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shared = self.positions and ids.shape[0] == 1
        ids = batch_block(ids, self.grid) if ids.dim() == 2 and not shared else ids
        return F.embedding(ids, gather_column(self.weight, self.grid), padding_idx=self.padding_idx)


class TiedHead2D(nn.Module):
    """An LM head whose weight is the embedding's table (tied, as GPT-2's), on the table's layout: rank (i, j) multiplies
    row i's tokens' features of column j by column j's feature block of the whole vocabulary (gathered along the column,
    as the lookup gathers it), and the row's partial logits are reduce-scattered by vocabulary block along the row. Rank
    (i, j) then holds row i's tokens x column j's vocabulary block, the layout of a `linear` head, for the same loss; the
    table's gradient sums the lookup's and the head's. Per rank: one [tokens/q, V] partial product transiently, and a
    reduce-scatter of it (an all-gather of its gradient in backward)."""

    chunkable = False  # a head computed across ranks

    def __init__(self, embedding: Embedding2D) -> None:
        super().__init__()
        self.weight, self.grid = embedding.weight, embedding.grid  # the same Parameter: tied as in one process

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = gemm.linear(x, gather_column(self.weight, self.grid).to(x.dtype))
        return _ScatterRow.apply(partial, self.grid)


class _ScatterRow(torch.autograd.Function):
    """Partial sums [..., n] over the row's features, reduce-scattered along the row by the last dimension (column j keeps
    block j of n); all-gathered backward."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, grid: Grid2D) -> torch.Tensor:
        ctx.grid = grid
        flat = partial.movedim(-1, 0).contiguous()
        out = flat.new_empty((flat.shape[0] // grid.q, *flat.shape[1:]))
        reduce_scatter(out, flat, grid.row_group, grid.meter)
        return out.movedim(0, -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grid: Grid2D = ctx.grid
        flat = grad.movedim(-1, 0).contiguous()
        out = flat.new_empty((grid.q * flat.shape[0], *flat.shape[1:]))
        all_gather(out, flat, grid.row_group, grid.meter)
        return out.movedim(0, -1), None


class LayerNorm2D(nn.Module):
    """LayerNorm (or RMSNorm: `rms`) over features split along the row: mean and variance (mean square) from row sums
    (two passes, as nn.LayerNorm); its weight and bias are column j's blocks, gathered from the column's pieces."""

    def __init__(
        self, weight: nn.Parameter | None, bias: nn.Parameter | None, width: int, eps: float, grid: Grid2D, rms: bool = False, offset: bool = False
    ) -> None:
        super().__init__()
        self.weight, self.bias, self.width, self.eps, self.grid, self.rms = weight, bias, width, eps, grid, rms
        self.offset = offset  # scales by 1 + w (Gemma)

    @classmethod
    def from_module(cls, module: nn.Module, name: str, grid: Grid2D, offset: bool = False) -> LayerNorm2D:
        width, eps, rms = norm_spec(module, name, "2-D", offset)
        weight, bias = (
            shard_parameter(p, f"{name}.{n}", vector_pieces(width, grid, f"{name}.{n}")) if isinstance(p, nn.Parameter) else None
            for n, p in (("weight", module.weight), ("bias", getattr(module, "bias", None)))
        )
        return cls(weight, bias, width, eps, grid, rms, offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = gather_column(self.weight, self.grid) if self.weight is not None else None
        weight = 1 + weight if self.offset and weight is not None else weight
        bias = gather_column(self.bias, self.grid) if self.bias is not None else None
        return _LayerNorm2D.apply(x, weight, bias, (self.width, self.eps, self.grid, self.rms))


def norm_spec(module: nn.Module, name: str, mode: str, offset: bool = False) -> tuple[int, float, bool]:
    """(width, eps, rms) of a norm the grid or cube splits: nn.LayerNorm over one dimension or an RMSNorm of the Llama
    kind (`offset`: of Gemma's, 1 + w); anything else is refused, naming the module."""
    if offset:
        if not (type(module).__name__.endswith("RMSNorm") and isinstance(getattr(module, "eps", None), float)):
            raise BehemothError(f"{name} is a {type(module).__name__}; the 2-D norm:offset style applies to a (1 + w) RMSNorm", "map it to norm")
        return int(module.weight.shape[0]), float(module.eps), True  # type: ignore[index,arg-type]
    rms = is_rms_norm(module)
    if not rms and (not isinstance(module, nn.LayerNorm) or len(module.normalized_shape) != 1):
        message = f"{name} is a {type(module).__name__}; the {mode} norm style applies to nn.LayerNorm over one dimension or an RMSNorm"
        raise BehemothError(message, "map it to another style")
    width: int = module.weight.shape[0] if rms else module.normalized_shape[0]  # type: ignore[index,assignment]
    return width, float(module.variance_epsilon if rms else module.eps), rms  # type: ignore[arg-type]


def is_rms_norm(module: nn.Module) -> bool:
    """transformers' RMSNorm of the Llama kind: y = w * x / sqrt(mean(x^2) + eps), its epsilon `variance_epsilon` (Gemma's,
    which scales by 1 + w and names it `eps`, is not one)."""
    weight = getattr(module, "weight", None)
    named = type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
    return named and isinstance(weight, nn.Parameter) and weight.dim() == 1


def _row_sums(t: torch.Tensor, grid: Grid2D) -> torch.Tensor:
    """Sums over the last dimension of every rank of the row (the full feature width of these tokens)."""
    out = t.sum(-1, keepdim=True)
    all_reduce(out, grid.row_group, grid.meter)
    return out


class _LayerNorm2D(torch.autograd.Function):
    """y = (x - mean) / sqrt(var + eps) * w + b over features split along the row; saves only the normalized block and
    the per-token 1/std, as nn.LayerNorm does (row sums: two in forward, one of two numbers per token in backward).
    RMSNorm (`rms`): y = x / sqrt(mean(x^2) + eps) * w, in float32 and cast back before the weight, as transformers'."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, spec: tuple[int, float, Grid2D, bool]) -> torch.Tensor:
        width, eps, grid, rms = spec
        centered = x.float() if rms else x - _row_sums(x, grid) / width
        rstd = torch.rsqrt(_row_sums(centered * centered, grid) / width + eps)
        normed = (centered * rstd if rms else centered.mul_(rstd)).to(x.dtype)  # rms: `centered` may be x itself
        ctx.save_for_backward(normed, rstd, weight)
        ctx.width, ctx.grid, ctx.has_bias, ctx.rms = width, grid, bias is not None, rms
        y = normed if weight is None else normed * weight
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        normed, rstd, weight = ctx.saved_tensors
        tokens = tuple(range(grad.dim() - 1))
        grad_w = (grad * normed).sum(tokens) if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = grad.sum(tokens) if ctx.has_bias and ctx.needs_input_grad[2] else None
        g = grad if weight is None else grad * weight
        if ctx.rms:  # no mean was taken out: only the mean-square's term
            g, n = g.float(), normed.float()
            sum_gn = (g * n).sum(-1, keepdim=True)
            all_reduce(sum_gn, ctx.grid.row_group, ctx.grid.meter)
            return (rstd * (g - n * sum_gn / ctx.width)).to(grad.dtype), grad_w, grad_b, None
        sums = torch.stack([g.sum(-1), (g * normed).sum(-1)], dim=-1)
        all_reduce(sums, ctx.grid.row_group, ctx.grid.meter)
        mean_g, mean_gn = (sums / ctx.width).unbind(-1)
        grad_x = rstd * (g - mean_g.unsqueeze(-1) - normed * mean_gn.unsqueeze(-1))
        return grad_x, grad_w, grad_b, None


class TensorParallel2D:
    """What applying a 2-D plan leaves behind (the interface of plan.TensorParallel): the head's vocabulary block for
    the loss, the layouts for checkpoints. Under 2-D no gradient is partial (each rank's blocks get their whole gradients
    from the grid's reductions) and no two tp ranks hold the same piece; under 2.5-D the d layers hold the same pieces
    and their gradients are summed over the depth."""

    sequence_parallel = False

    def __init__(self, model: nn.Module, grid: Grid2D, vocab: VocabShard | None, replicated: frozenset[str] = frozenset()) -> None:
        self.grid, self.vocab = grid, vocab
        named = list(model.named_parameters(remove_duplicate=False))
        self.layouts = {n: getattr(p, TP_LAYOUT) for n, p in named if hasattr(p, TP_LAYOUT)}
        self.split_layouts = {getattr(p, FULL_NAME, n): layout for n, p in named if (layout := getattr(p, TP_LAYOUT, None)) is not None}
        self.replicated = replicated | {getattr(p, FULL_NAME, n) for n, p in named if n in replicated}  # whole on every rank

    @torch.no_grad()
    def finish_grads(self, slices: list[tuple[str, torch.Tensor]]) -> None:
        """2-D: nothing to sum but the replicated parameters' (over the row, then the column); every other gradient
        already is this rank's block's whole gradient. 2.5-D: each layer's is its share of the batch's, summed over the
        depth in one all-reduce (whole or ZeRO slices: equal layouts)."""
        whole = [g for name, g in slices if name in self.replicated]
        reduce_flat(whole, self.grid.row_comm().all_reduce)
        reduce_flat(whole, self.grid.col_comm().all_reduce)
        depth = self.grid.depth_comm()
        if depth is not None:
            reduce_flat([g for _, g in slices], depth.all_reduce)

    def copies(self, name: str) -> int:
        """Ranks of the tp group holding this parameter's piece: one per layer of the depth (every rank: replicated)."""
        return self.grid.depth * (self.grid.q**2 if name in self.replicated else 1)

    def activation_block(self, hidden_size: int) -> tuple[int, int]:
        """(hidden features, sequence blocks) of this rank's piece of a [batch, T, hidden] residual activation: column
        j's features of row i's (layer l's) sequences; what pipeline stages exchange."""
        return hidden_size // self.grid.q, self.grid.batch_blocks

    def cross_entropy_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The micro-batch's summed token loss on every rank, from row i's sequences x column j's vocabulary logits."""
        if self.vocab is None or logits.shape[-1] != self.vocab.padded:
            raise BehemothError("2-D tensor parallelism needs the LM head in its plan (a vocabulary block per column)", "map lm_head to linear")
        mine = batch_block(targets, self.grid)
        loss = reduce_from_tp(vocab_parallel_cross_entropy(logits, mine, self.vocab, self.grid.row_comm()).sum(), self.grid.col_comm())
        depth = self.grid.depth_comm()
        return loss if depth is None else reduce_from_tp(loss, depth)

    def checkpoint_views(self, state: dict[str, Any]) -> dict[str, Any]:
        """Blocks as full-shape views under single-process names, so DCP reshards to any layout."""
        return checkpoint_views(state, self.layouts)


def apply_tensor_parallel_2d(model: nn.Module, grid: Grid2D, plan: dict[str, str]) -> TensorParallel2D:
    """Replace the modules `plan` names by their 2-D versions (on the meta device or not); refuse a plan that leaves a
    parameter whole or a tied head (its one table would need two layouts)."""
    styles = match_plan(plan, [n for n, _ in model.named_modules() if n], STYLES_2D)
    vocab, replicated = None, set()
    tables = {id(getattr(model.get_submodule(n), "weight", None)): n for n, s in styles.items() if s.startswith("embedding")}
    tied = {n: tables[id(w)] for n, s in styles.items() if s == "linear" and id(w := getattr(model.get_submodule(n), "weight", None)) in tables}
    for name, style in styles.items():
        module = model.get_submodule(name)
        kind, _, arg = style.partition(":")
        new: nn.Module
        if kind == "replicated":
            replicated |= keep_whole(module, name)
            continue
        if name in tied:
            continue  # after its table (below)
        if kind == "linear":
            new = Linear2D.from_module(module, name, grid, int(arg or 1))
        elif kind == "embedding":
            new = Embedding2D.from_module(module, name, grid, positions=arg == "positions")
        else:
            new = LayerNorm2D.from_module(module, name, grid, offset=arg == "offset")
        model.set_submodule(name, new)
    for name, table in tied.items():
        model.set_submodule(name, TiedHead2D(model.get_submodule(table)))  # type: ignore[arg-type]
    whole = [n for n, p in model.named_parameters(remove_duplicate=False) if not hasattr(p, TP_LAYOUT)]
    if whole:
        raise BehemothError(f"2-D tensor parallelism: {', '.join(whole[:3])} is not split by the 2-D plan", "map it in the plan")
    head = styles.get("lm_head")
    if head is not None:
        v = int(model.get_submodule("lm_head").weight.shape[0])  # type: ignore[index]  # a Linear2D's block
        v = v // grid.q if "lm_head" in tied else v  # the tied table holds every row of the vocabulary
        vocab = VocabShard(grid.col * v, v, v)
    return TensorParallel2D(model, grid, vocab, frozenset(replicated))


def keep_whole(module: nn.Module, name: str) -> set[str]:
    """Mark `module`'s parameters as held whole on every rank (a layout of the full tensor); their names."""
    out = set()
    for pname, p in list(module.named_parameters(recurse=True)):
        full = f"{name}.{pname}"
        holder = module.get_submodule(pname.rpartition(".")[0]) if "." in pname else module
        setattr(holder, pname.rpartition(".")[2], shard_parameter(p, full, BlockLayout.of(tuple(p.shape))))
        out.add(full)
    return out


def grid_of(mesh_ranks: torch.Tensor, tp_dim: int, meter: CommMeter, depth: int = 1, shared_batch: bool = False) -> Grid2D:
    """This rank's grid from the mesh's global ranks (every tp group's, in tp order); `depth` > 1: 2.5-D; `shared_batch`:
    every row runs the whole batch (inference)."""
    tp = mesh_ranks.shape[tp_dim]
    groups = mesh_ranks.movedim(tp_dim, -1).reshape(-1, tp).tolist()
    return Grid2D.build(groups, dist.get_rank(), meter, depth, shared_batch)
