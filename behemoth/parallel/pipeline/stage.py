"""The compute passes of one stage for one micro-batch: forward, full backward, and the split
backward of zero-bubble schedules (input gradient now, weight gradient later).

The split uses torch's own graph-splitting helpers (`torch.distributed.pipelining._backward`,
torch pinned to 2.13): the input-gradient pass walks only the path to the stage input and
captures, at each node where a weight's gradient branches off, the gradient flowing into it; the
weight-gradient pass starts from those captures, so neither pass repeats the other's work. The
first stage has no input gradient to send, so its input pass does nothing and its weight pass is
the full backward (as torch.distributed.pipelining does).

`StashMeter` counts the bytes autograd keeps for backward (activations, not parameters), so the
memory each stage holds is measured, not assumed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
from torch import nn


@dataclass
class Stashed:
    """What a forward leaves for its backward: the stage input (a leaf), the output or loss, its bytes."""

    input: torch.Tensor | None  # None on the first stage (token ids need no gradient)
    output: torch.Tensor
    nbytes: int
    output_grad: torch.Tensor | None = None  # set by the input-gradient pass for the weight pass
    param_groups: list[dict[str, Any]] | None = field(default=None, repr=False)


def backward_full(s: Stashed, output_grad: torch.Tensor | None) -> torch.Tensor | None:
    """Gradients of the weights (accumulated into .grad) and of the stage input (returned)."""
    torch.autograd.backward(s.output, output_grad)
    return None if s.input is None else s.input.grad


def backward_input(s: Stashed, output_grad: torch.Tensor | None, params: list[nn.Parameter]) -> torch.Tensor | None:
    """The input gradient only, capturing what the weight pass needs; None (and no work) on the first stage."""
    if s.input is None:
        s.output_grad = output_grad
        return None
    grads, s.param_groups = stage_backward_input([s.output], None if output_grad is None else [output_grad], [s.input], iter(params))
    return grads[0]


def backward_weight(s: Stashed, params: list[nn.Parameter]) -> None:
    """The weight gradients deferred by `backward_input`, accumulated into .grad."""
    if s.input is None:
        torch.autograd.backward(s.output, s.output_grad)
        return
    stage_backward_weight(iter(params), s.param_groups)
    s.param_groups = None


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
    def measure(self) -> Iterator["StashMeter"]:
        """Count what the forward inside the block saves; read `.bytes` afterwards."""
        self.seen, self.bytes = set(), 0
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self
        self.seen = set()
