"""Context parallelism: one sequence over the cp ranks, attention by ring (load-balanced causal chunks) or Ulysses."""

from behemoth.parallel.context.apply import ContextParallel, ContextPolicy, apply_context_parallel, context_attention, heads_per_rank, resolve_mode
from behemoth.parallel.context.layout import ContextLayout

__all__ = ["ContextLayout", "ContextParallel", "ContextPolicy", "apply_context_parallel", "context_attention", "heads_per_rank", "resolve_mode"]
