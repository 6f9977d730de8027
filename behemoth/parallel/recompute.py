"""Activation recomputation (torch.utils.checkpoint), per pipeline stage where the plan asks for it.

Under 1F1B rank r of p holds the activations of p - r micro-batches at once, so the first stage
needs p times the activation memory of the last. Stage-aware recomputation (Merak, Lai et al.
2022) recomputes only where the stash is large: the policy `early` picks the ranks whose peak
stash (from the schedule itself) is more than half the largest, so memory evens out while the
last stages, which hold little, pay no recomputation. A plan may also name the ranks by hand.

A block is checkpointed by wrapping its `forward` in place, so module and parameter names stay
the single-process ones (initialization and checkpoints depend on them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from behemoth.errors import BehemothError

RecomputePolicy = str | list[int]


def recompute_ranks(policy: RecomputePolicy, peak_stash: Sequence[int]) -> set[int]:
    """The pipeline ranks that recompute, given each rank's peak stash (micro-batches held at once)."""
    ranks = len(peak_stash)
    if isinstance(policy, list):
        bad = [r for r in policy if not 0 <= r < ranks]
        if bad:
            raise BehemothError(
                f"parallel.recompute={policy} names pipeline ranks {bad}, but there are {ranks} (0..{ranks - 1})",
                "name ranks in that range, or use none, full or early",
            )
        return set(policy)
    if policy == "none":
        return set()
    if policy == "full":
        return set(range(ranks))
    if policy == "early":
        if ranks == 1:
            return set()
        half = max(peak_stash) / 2
        return {r for r, held in enumerate(peak_stash) if held > half}
    raise BehemothError(f"parallel.recompute={policy!r} is not a policy", "use none, full, early or a list of pipeline ranks")


def checkpoint_module(module: nn.Module) -> None:
    """Recompute `module`'s activations in backward instead of keeping them (non-reentrant checkpoint)."""
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward  # an instance attribute: names, hooks and state dict are unchanged
    module._behemoth_recompute = True


def apply_recompute(blocks: Iterable[nn.Module], enabled: bool) -> int:
    """Checkpoint every block in `blocks` if `enabled`; the number checkpointed."""
    count = 0
    for block in blocks if enabled else ():
        if not getattr(block, "_behemoth_recompute", False):
            checkpoint_module(block)
            count += 1
    return count
