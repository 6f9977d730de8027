"""The compute passes of one stage for one micro-batch: forward, full backward, and the split
backward of zero-bubble schedules (input gradient now, weight gradient later).

The split defers the weight gradients of the stage's linear layers (parallel/deferred.py): the
input-gradient pass is one ordinary autograd backward in which each linear layer returns only its
input gradient and queues its weight-gradient matmul; the weight-gradient pass runs the queue.
Neither pass repeats the other's work, and no graph is walked twice. The first stage has no input
gradient to send, so its input pass does nothing and its weight pass is the full backward (as
torch.distributed.pipelining does).

`StashMeter` counts the bytes autograd keeps for backward (activations, not parameters), so the
memory each stage holds is measured, not assumed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from behemoth.parallel.deferred import DeferralSlot, WeightGradQueue


@dataclass
class Stashed:
    """What a forward leaves for its backward: the stage input (a leaf), the output or loss, its bytes."""

    input: torch.Tensor | None  # None on the first stage (token ids need no gradient)
    output: torch.Tensor
    nbytes: int
    output_grad: torch.Tensor | None = None  # the first stage's output gradient, kept for its weight pass
    deferred: WeightGradQueue | None = field(default=None, repr=False)  # the input pass's weight-gradient products


def backward_full(s: Stashed, output_grad: torch.Tensor | None) -> torch.Tensor | None:
    """Gradients of the weights (accumulated into .grad) and of the stage input (returned)."""
    torch.autograd.backward(s.output, output_grad)
    return None if s.input is None else s.input.grad


def backward_input(s: Stashed, output_grad: torch.Tensor | None, slot: DeferralSlot) -> torch.Tensor | None:
    """The input gradient, with the linear layers' weight gradients queued for the weight pass (other parameters get
    theirs now); None (and no work) on the first stage."""
    if s.input is None:
        s.output_grad = output_grad
        return None
    s.deferred = slot.queue = WeightGradQueue()
    try:
        torch.autograd.backward(s.output, output_grad)
    finally:
        slot.queue = None
    return s.input.grad


def backward_weight(s: Stashed) -> None:
    """The weight gradients deferred by `backward_input`, accumulated into .grad."""
    if s.input is None:
        torch.autograd.backward(s.output, s.output_grad)
        return
    s.deferred.run()
    s.deferred = None


class StashMeter:
    """Bytes of distinct storages autograd saves for backward during a forward, parameters excluded."""

    def __init__(self) -> None:
        self.excluded: set[int] = set()
        self.seen: set[int] = set()
        self.bytes = 0

    def exclude(self, params: list[nn.Parameter]) -> None:
        self.excluded = {p.untyped_storage().data_ptr() for p in params}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.excluded and key not in self.seen and t.device.type != "meta":
            self.seen.add(key)
            self.bytes += storage.nbytes()
        return t

    @contextlib.contextmanager
    def measure(self) -> Iterator[StashMeter]:
        """Count what the forward inside the block saves; read `.bytes` afterwards."""
        self.seen, self.bytes = set(), 0
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self
        self.seen = set()
