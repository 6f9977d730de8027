"""A tensor-parallel plan is data: module-name pattern -> style. `apply_tensor_parallel` carries it out on a
model that knows nothing of parallelism, replacing modules by name so parameter names do not change.

Styles:
    colwise            a linear layer split along its outputs (Megatron column-parallel)
    packed_colwise:K   the same for K fused equal parts (a fused [q|k|v]): each part split separately, whole heads
    rowwise            split along its inputs; the partial outputs are all-reduced (reduce-scattered under SP)
    vocab              nn.Embedding or LM-head nn.Linear split along the vocabulary (padded when t does not divide it)
    sequence_norm      a norm whose output feeds column-parallel layers: its output enters the tensor-parallel
                       region (f, once for q, k and v); under SP it runs on this rank's sequence shard, all-gathers
                       its output, and its parameters' gradients are summed over tp
    sequence_input     the first block: under SP its input is split along the sequence (no-op otherwise)
    position_embedding a learned position embedding added to the vocab embedding's output. Under SP, when every
                       other embedding is styled so, the vocab embedding's partial sums are not all-reduced: the
                       first block reduce-scatters them (Megatron's reduce-scattered embedding), only tp rank 0 adds
                       the position embedding, and its gradient is summed over tp. Whatever runs between the
                       embeddings and the first block must be linear (sums, dropout with the same seed on every rank)
    sequence_replicate a norm whose output feeds a module computed whole on every tp rank (an MoE layer): left as is
                       without SP; under SP it runs on this rank's sequence shard, all-gathers its output (backward:
                       the shard of a gradient complete on every rank), and its parameters' gradients are summed over
                       tp. The MoE layer's whole output re-enters the SP region in parallel/expert/ (its shard kept)
    grad_sum           left whole, but its parameters' gradients are partial sums over tp (a norm applied to each
                       rank's heads, as Qwen3's q_norm / k_norm: transformers' replicated_with_grad_allreduce)
    replicate          left as is

`*` in a pattern matches one name component (`blocks.*.attn.qkv`). Column-parallel layers (colwise,
packed_colwise, a vocab head) expect their input from a `sequence_norm`: the plan states where the
tensor-parallel region starts, as in Megatron, where f sits between the LayerNorm and the linear layer.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from behemoth.comm import reduce_flat
from behemoth.errors import BehemothError
from behemoth.models.causal_lm import summed_token_loss
from behemoth.models.chunked_loss import VocabSplit, chunked_cross_entropy_sum, head_input_of
from behemoth.models.init import FULL_NAME
from behemoth.parallel.chunked import checkpoint_views
from behemoth.parallel.tensor.adapters import carry_adapter
from behemoth.parallel.tensor.comm import TPComm, gather_seq_whole, reduce_scatter_seq, scatter_seq
from behemoth.parallel.tensor.layers import (
    TP_LAYOUT,
    TP_PARTIAL_GRAD,
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabShard,
    enter_tp_region,
    vocab_parallel_cross_entropy,
)

STYLES = (
    "colwise",
    "packed_colwise",
    "rowwise",
    "vocab",
    "sequence_norm",
    "sequence_replicate",
    "sequence_input",
    "position_embedding",
    "grad_sum",
    "replicate",
)
NORM_STYLES = ("sequence_norm", "sequence_replicate")  # what SP accepts for a norm


def pattern_regex(pattern: str) -> re.Pattern:
    return re.compile("^" + r"[^.]+".join(re.escape(part) for part in pattern.split("*")) + "$")


def match_plan(plan: dict[str, str], names: list[str], known: tuple[str, ...] = STYLES) -> dict[str, str]:
    """Module name -> style for every module a pattern names (the first matching pattern wins); styles among `known`."""
    compiled = [(pattern_regex(p), style) for p, style in plan.items()]
    for _, style in compiled:
        if style.split(":")[0] not in known:
            raise BehemothError(f"tensor-parallel style {style!r} is unknown", f"use one of {', '.join(known)}")
    found = {}
    for name in names:
        style = next((s for rx, s in compiled if rx.match(name)), None)
        if style is not None:
            found[name] = style
    return found


@dataclass(frozen=True)
class TensorPolicy:
    """A tensor-parallel plan and what the model says about its modules: which linear layers hold a transposed
    weight ([in, out]) and which modules are norms (sequence parallelism must style every one)."""

    plan: dict[str, str]
    sequence_parallel: bool = False
    transposed: frozenset[str] = frozenset()
    norms: frozenset[str] = frozenset()


class TensorParallel:
    """What applying a plan leaves behind: the head's vocabulary split, the SP gradient sum, checkpoint views.

    After the data-parallel reduction, the gradient of a replicated parameter that sequence parallelism runs on a
    sequence shard (norm weights, row-parallel biases) is a partial sum on each tp rank: `finish_grads` sums them
    over tp in one all-reduce, once per step (sums over dp and over tp commute, and accumulation over micro-batches
    is a sum too). Gradients may be whole or this rank's ZeRO slices: ZeRO's flat layouts are identical on every tp
    rank (split parameters have equal local shapes on all of them), so the slices line up element by element.
    """

    def __init__(self, model: nn.Module, tp: TPComm, sequence_parallel: bool, vocab: VocabShard | None) -> None:
        self.tp, self.sequence_parallel, self.vocab = tp, sequence_parallel, vocab
        named = list(model.named_parameters(remove_duplicate=False))
        # split parameters' layouts by every name they are registered under (a tied head too), and the
        # single-process names of replicated parameters whose gradients SP leaves partial
        self.layouts = {n: getattr(p, TP_LAYOUT) for n, p in named if hasattr(p, TP_LAYOUT)}
        self.partial = {getattr(p, FULL_NAME, n) for n, p in named if getattr(p, TP_PARTIAL_GRAD, False)}
        self.split_layouts = {getattr(p, FULL_NAME, n): layout for n, p in named if (layout := getattr(p, TP_LAYOUT, None)) is not None}

    @torch.no_grad()
    def finish_grads(self, slices: list[tuple[str, torch.Tensor]]) -> None:
        """Sum the SP-partial gradients among `slices` (name, gradient or its ZeRO slice) over tp, in one all-reduce."""
        reduce_flat([g for name, g in slices if name in self.partial], self.tp.all_reduce)

    def copies(self, name: str) -> int:
        """tp ranks holding an identical copy of this parameter's gradient: 1 if split, else all of them."""
        return 1 if name in self.layouts else self.tp.size

    def cross_entropy_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token loss; with a vocabulary-parallel head the logits are this rank's vocabulary shard (or a deferred
        head's input, its weight this rank's vocabulary rows: chunk by chunk, two all-reduces per chunk)."""
        head = head_input_of(logits)
        if head is not None:
            vocab = self.vocab if self.vocab is not None and head.weight.shape[1 if head.transposed else 0] == self.vocab.padded else None
            return chunked_cross_entropy_sum(logits, targets, VocabSplit(vocab.start, vocab.real, self.reduce) if vocab is not None else None)
        if self.vocab is None or logits.shape[-1] != self.vocab.padded:  # the head was not split
            return summed_token_loss(logits, targets)
        return vocab_parallel_cross_entropy(logits, targets, self.vocab, self.tp).sum()

    def reduce(self, t: torch.Tensor, op: str) -> None:
        """All-reduce `t` in place over tp: "max" or "sum" (the chunked loss's per-chunk statistics)."""
        self.tp.all_reduce(t, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)

    def checkpoint_views(self, state: dict[str, Any]) -> dict[str, Any]:
        """Engine state (`{"model": {name: t}, "optim": {name: {key: t}}}`) with split tensors as full-shape views.

        A tensor may be this rank's whole tp part, or ZeRO's chunks of it: either becomes chunks of the full tensor.
        """
        return checkpoint_views(state, self.layouts)


def apply_tensor_parallel(model: nn.Module, tp: TPComm, policy: TensorPolicy) -> TensorParallel:
    """Replace the modules the policy's plan names with their tensor-parallel versions (on the meta device or not)."""
    sequence_parallel = policy.sequence_parallel
    styles = match_plan(policy.plan, [n for n, _ in model.named_modules() if n])
    check_plan(model, policy, styles)
    build = Build(tp, sequence_parallel, sequence_parallel and embedding_reduce_scatters(model, styles), policy.transposed)
    vocab = None
    for name, style in styles.items():
        module = model.get_submodule(name)
        kind, _, arg = style.partition(":")
        new = build_parallel(module, name, kind, int(arg or 1), build)
        if new is not None:
            carry_adapter(module, new, name, kind, int(arg or 1), tp, sequence_parallel)
            model.set_submodule(name, new)
            if kind == "vocab":
                vocab = new.vocab if isinstance(new, VocabParallelEmbedding) else VocabShard.of(getattr(new.weight, TP_LAYOUT))
    return TensorParallel(model, tp, sequence_parallel, vocab)


def plan_tensor_parallel(model: nn.Module, degree: int, policy: TensorPolicy) -> TensorParallel:
    """The split `apply_tensor_parallel` makes on a rank of a `degree`-wide group, without the group: for the planner, on
    the meta device (every tp rank holds equal shapes; the result runs no collective)."""
    return apply_tensor_parallel(model, TPComm(None, degree, 0), policy)  # type: ignore[arg-type]  # construction reads size and rank only


@dataclass
class Build:
    """What every module's replacement needs: the group, SP, whether the embedding is reduce-scattered, tied weights."""

    tp: TPComm
    sp: bool
    scatter_embedding: bool  # SP: the vocab embedding's partial sums are reduce-scattered by the first block
    transposed: frozenset[str]  # linear modules whose weight is [in, out]
    replaced: dict[int, nn.Parameter] = field(default_factory=dict)  # id(original weight) -> its split version


def embedding_reduce_scatters(model: nn.Module, styles: dict[str, str]) -> bool:
    """Whether the vocab embedding's output may stay partial until the first block: every other embedding is a
    position_embedding (which then only tp rank 0 adds); otherwise it is all-reduced, then split."""
    kinds = [styles.get(n) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    return "vocab" in kinds and all(k in ("vocab", "position_embedding") for k in kinds)


def build_parallel(module: nn.Module, name: str, kind: str, parts: int, build: Build) -> nn.Module | None:
    """The parallel replacement of one module, or None where the style only adds hooks."""
    original, tp, sp, replaced = getattr(module, "weight", None), build.tp, build.sp, build.replaced
    transposed = name in build.transposed
    if kind in ("colwise", "packed_colwise"):
        new: nn.Module = ColumnParallelLinear.from_module(module, name, tp, sequence_parallel=sp, transposed=transposed, parts=parts)
    elif kind == "rowwise":
        new = RowParallelLinear.from_module(module, name, tp, sequence_parallel=sp, transposed=transposed)
    elif kind == "vocab" and isinstance(module, nn.Embedding):
        new = VocabParallelEmbedding.from_module(module, name, tp)
        new.reduce_output = not build.scatter_embedding
    elif kind == "vocab":
        new = ColumnParallelLinear.from_module(module, name, tp, sequence_parallel=sp, padded=True)
    elif kind == "sequence_norm":
        add_sequence_norm(module, tp, sp)
        return None
    elif kind == "sequence_replicate":
        if sp:
            add_sequence_replicate(module, tp)
        return None
    elif kind == "sequence_input":
        if sp:
            module.register_forward_pre_hook(sequence_input_hook(tp, build.scatter_embedding), with_kwargs=True)
        return None
    elif kind == "grad_sum":
        for p in module.parameters(recurse=False):
            setattr(p, TP_PARTIAL_GRAD, True)
        return None
    elif kind == "position_embedding":
        if build.scatter_embedding:
            add_position_embedding(module, tp)
        return None
    else:
        return None
    if original is not None and id(original) in replaced:
        new.weight = replaced[id(original)]
    elif original is not None:
        replaced[id(original)] = new.weight
    return new


def add_sequence_norm(module: nn.Module, tp: TPComm, sequence_parallel: bool) -> None:
    """The norm's output enters the tensor-parallel region; under SP its parameters' gradients are partial."""
    if sequence_parallel:
        for p in module.parameters(recurse=False):
            setattr(p, TP_PARTIAL_GRAD, True)
    module.register_forward_hook(lambda _m, _args, out: enter_tp_region(out, tp, sequence_parallel))


def add_sequence_replicate(module: nn.Module, tp: TPComm) -> None:
    """Under SP: the norm runs on this rank's shard, its parameters' gradients are partial, its output is gathered for
    a consumer computed whole on every rank (`gather_seq_whole`)."""
    for p in module.parameters(recurse=False):
        setattr(p, TP_PARTIAL_GRAD, True)
    module.register_forward_hook(lambda _m, _args, out: gather_seq_whole(out, tp))


def add_position_embedding(module: nn.Module, tp: TPComm) -> None:
    """Only tp rank 0 adds the position embedding to the partial sums the first block reduce-scatters."""
    for p in module.parameters(recurse=False):
        setattr(p, TP_PARTIAL_GRAD, True)
    if tp.rank != 0:
        module.register_forward_hook(lambda _m, _args, out: out * 0.0)


def sequence_input_hook(tp: TPComm, reduce: bool) -> Callable[..., Any]:
    """A forward pre-hook that splits the block's hidden states (first argument) along the sequence; with `reduce`
    they are partial sums over tp (a reduce-scattered embedding), summed as they are split."""
    enter = reduce_scatter_seq if reduce else scatter_seq

    def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (enter(args[0], tp), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": enter(kwargs["hidden_states"], tp)}

    return hook


def check_plan(model: nn.Module, policy: TensorPolicy, styles: dict[str, str]) -> None:
    """Refuse plans that would silently train wrong: column layers with no region entry, SP norms left out.

    `styles` are the plan's matches in `model`, which may be one pipeline stage: a later stage holds no block 0,
    so its `sequence_input` entry matches nothing (its input arrives already split along the sequence), and only
    the norms it holds must be styled."""
    kinds = {s.split(":")[0] for s in styles.values()}
    if kinds & {"colwise", "packed_colwise", "rowwise"} and "sequence_norm" not in kinds:
        raise BehemothError(
            "the tensor-parallel plan splits linear layers but names no sequence_norm where their region starts",
            "map the norm before each column-parallel layer to sequence_norm",
        )
    if not policy.sequence_parallel:
        return
    present = {n for n, _ in model.named_modules()}
    missing = sorted(n for n in policy.norms & present if styles.get(n) not in NORM_STYLES)
    if missing:
        raise BehemothError(
            f"sequence parallelism needs every norm in the plan, but {', '.join(missing[:3])} has no sequence_norm style",
            "add them to the tensor-parallel plan or set parallel.sequence_parallel=false",
        )
    if "sequence_input" not in policy.plan.values():
        raise BehemothError("sequence parallelism needs a sequence_input entry (the first block) in the plan", "add one")
