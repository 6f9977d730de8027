"""LoRA adapters under tensor parallelism: split consistently with the base layer they adapt (Megatron's rule for
y = W x + s B A x).

Column-parallel base (W split on outputs; x replicated in the tensor-parallel region): A is replicated and B is split
on its outputs like W, so each rank adds B_r A x to its own output features. A's gradient, sum_r B_r^T dy_r x^T,
is a partial sum on each rank: it is marked so the tensor-parallel gradient sum (`TensorParallel.finish_grads`)
adds it over tp.

Row-parallel base (W split on inputs; x split on features): A is split on its inputs like W and B is replicated;
the r-wide partial products A_r x_r are summed over tp (reduce-scattered along the sequence under sequence
parallelism, as the base layer's output is) before B. Without SP every rank then holds the same B gradient; under
SP each holds its sequence shard's part, so B is marked for the tp sum too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from behemoth.errors import BehemothError
from behemoth.models.init import ADAPTER
from behemoth.models.lora import LORA_A, LORA_B, LORA_DROPOUT, LORA_HOOK, LORA_SCALING, add_low_rank, has_adapter
from behemoth.parallel.tensor.comm import TPComm, reduce_from_tp, reduce_scatter_seq
from behemoth.parallel.tensor.layers import TP_PARTIAL_GRAD, ShardLayout, shard_parameter


def add_row_parallel_low_rank(module: nn.Module, args: tuple, out: torch.Tensor, *, tp: TPComm, sequence_parallel: bool) -> torch.Tensor:
    """Forward hook of a row-parallel base: out + s B (sum over tp of A_r dropout(x_r))."""
    a = getattr(module, LORA_A)
    h = a(getattr(module, LORA_DROPOUT)(args[0].to(a.weight.dtype)))
    h = reduce_scatter_seq(h, tp) if sequence_parallel else reduce_from_tp(h, tp)
    return out + (getattr(module, LORA_B)(h) * getattr(module, LORA_SCALING)).to(out.dtype)


def split_weight(linear: nn.Linear, name: str, dim: int, tp: TPComm, parts: int = 1) -> None:
    """Replace an adapter matrix by this rank's part of it (along `dim`), keeping it marked as an adapter."""
    weight = linear.weight
    assert isinstance(weight, nn.Parameter)
    layout = ShardLayout.split(name, tuple(weight.shape), dim, tp, parts)
    linear.weight = shard_parameter(weight, name, layout)
    setattr(linear.weight, ADAPTER, True)


def carry_adapter(old: nn.Module, new: nn.Module, name: str, kind: str, parts: int, tp: TPComm, sequence_parallel: bool) -> None:
    """Move `old`'s LoRA adapter (if any) onto its tensor-parallel replacement `new`, split as the module docstring says."""
    if not has_adapter(old):
        return
    if kind not in ("colwise", "packed_colwise", "rowwise"):
        raise BehemothError(
            f"{name} has a LoRA adapter but tensor-parallel style {kind!r}; adapters split with column- or row-parallel layers",
            "leave it out of finetune.lora.targets",
        )
    a, b = getattr(old, LORA_A), getattr(old, LORA_B)
    hook: Callable[..., torch.Tensor]
    if kind == "rowwise":
        split_weight(a, f"{name}.{LORA_A}.weight", 1, tp)
        if sequence_parallel:
            setattr(b.weight, TP_PARTIAL_GRAD, True)
        hook = functools.partial(add_row_parallel_low_rank, tp=tp, sequence_parallel=sequence_parallel)
    else:
        split_weight(b, f"{name}.{LORA_B}.weight", 0, tp, parts)
        setattr(a.weight, TP_PARTIAL_GRAD, True)
        hook = add_low_rank
    for attr in (LORA_A, LORA_B, LORA_DROPOUT, LORA_SCALING):
        setattr(new, attr, getattr(old, attr))
    setattr(new, LORA_HOOK, new.register_forward_hook(hook))
