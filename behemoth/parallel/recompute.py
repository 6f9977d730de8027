"""Activation recomputation (torch.utils.checkpoint), per pipeline stage where the plan asks for it.

Under 1F1B rank r of p holds the activations of p - r micro-batches at once, so the first stage
needs p times the activation memory of the last. Stage-aware recomputation (Merak, Lai et al.
2022) recomputes only where the stash is large: the policy `early` picks the ranks whose peak
stash (from the schedule itself) is more than half the largest, so memory evens out while the
last stages, which hold little, pay no recomputation. A plan may also name the ranks by hand.

A block is checkpointed by wrapping its `forward` in place, so module and parameter names stay
the single-process ones (initialization and checkpoints depend on them).

A streamed model (offload's streamer) cannot let autograd hold a block's graph from forward to backward: the
block's parameters are evicted in between. It keeps each block's input and random state instead
(`save_rng`), and in backward `recompute_backward` runs the block's forward again from that input with that
random state (dropout draws the same masks, as torch.utils.checkpoint's preserved state does) and its backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
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


RngState = tuple[torch.Tensor, torch.Tensor | None]  # the CPU generator's state, and the device's (None off CUDA)


def save_rng(device: torch.device) -> RngState:
    """The random state a forward starts from, to replay it when the forward is recomputed."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def replayed_rng(saved: RngState, device: torch.device) -> Iterator[None]:
    """The random state `saved` for the recomputation only; the generators continue as before afterwards."""
    cpu, dev = saved
    with torch.random.fork_rng(devices=[device] if dev is not None else []):
        torch.set_rng_state(cpu)
        if dev is not None:
            torch.cuda.set_rng_state(dev, device)
        yield


def recompute_backward(
    forward: Callable[[torch.Tensor], torch.Tensor],
    kept: torch.Tensor,
    grad_out: torch.Tensor,
    saved: RngState,
    *,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    input_grad: bool = True,
) -> torch.Tensor | None:
    """Backward of a segment whose forward ran without autograd: `forward` again from its kept input, with the random
    state it had, then its backward with `grad_out`; the gradient of the input (None when `input_grad` is off: token ids)."""
    x = kept.detach().requires_grad_() if input_grad else kept
    with replayed_rng(saved, grad_out.device), context():
        out = forward(x)
    torch.autograd.backward(out, grad_out)
    return x.grad if input_grad else None
