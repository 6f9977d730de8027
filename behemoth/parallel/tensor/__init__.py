"""Megatron-style tensor parallelism with sequence parallelism: layers, plans as data, checkpoint views."""

from behemoth.parallel.tensor.comm import TPComm
from behemoth.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardLayout,
    VocabParallelEmbedding,
    VocabShard,
    vocab_parallel_cross_entropy,
)
from behemoth.parallel.tensor.plan import STYLES, TensorParallel, TensorPolicy, apply_tensor_parallel, plan_tensor_parallel

__all__ = [
    "TPComm",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ShardLayout",
    "VocabParallelEmbedding",
    "VocabShard",
    "vocab_parallel_cross_entropy",
    "STYLES",
    "TensorParallel",
    "TensorPolicy",
    "apply_tensor_parallel",
    "plan_tensor_parallel",
]
