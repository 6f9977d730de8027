"""Deferred weight gradients: linear layers whose backward can give the input gradient now and leave the weight
gradient, one matmul of the saved input and the output gradient, for a later pass (zero-bubble's W).

Zero-bubble schedules split a stage's backward into an input-gradient pass (B, on the critical path: the
previous stage waits for it) and a weight-gradient pass (W, filling bubbles). The split costs nothing extra
when the weight gradient of each linear layer is computed directly from what backward already has: the
layer's input, saved by its forward, and its output gradient, captured when B passes through it. B is then
a plain autograd backward in which each deferrable linear returns only its input gradient and queues
(weight, bias, input, output gradient); W runs the queued products. Everything else (norms, embeddings,
layers that cannot defer) gets its gradient in B, so the split is exact whatever the model holds.

A model's linear layers are made deferrable in place (`make_deferrable`: their `forward` becomes an instance
attribute; names, parameters and state dicts do not change). Outside a split backward (no queue set on the
`DeferralSlot`) they compute every gradient at once, as an ordinary linear layer does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from behemoth.models import gemm


class WeightGradQueue:
    """The weight-gradient products one input-gradient pass deferred, each a call that adds them into `.grad`."""

    def __init__(self) -> None:
        self.items: list[Callable[[], None]] = []

    def defer(self, product: Callable[[], None]) -> None:
        self.items.append(product)

    @torch.no_grad()
    def run(self) -> None:
        """Compute every queued weight (and bias) gradient."""
        for product in self.items:
            product()
        self.items = []


def linear_weight_grads(weight: nn.Parameter, bias: nn.Parameter | None, x: torch.Tensor, g: torch.Tensor, transposed: bool) -> None:
    """Add a linear layer's weight and bias gradients, from its input and output gradient, into their `.grad`."""
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1]).to(g.dtype)
    accumulate(weight, gemm.mm(x2.t(), g2) if transposed else gemm.mm(g2.t(), x2))
    if bias is not None:
        accumulate(bias, g2.sum(0))


def accumulate(p: nn.Parameter, grad: torch.Tensor) -> None:
    """p.grad += grad, keeping an existing gradient tensor (it may be a view into a bucket)."""
    if p.grad is None:
        p.grad = grad.to(p.dtype)
    else:
        p.grad.add_(grad.to(p.grad.dtype))


class DeferralSlot:
    """Where the layers of one rank's model put deferred products: the queue of the pass running now, or None."""

    def __init__(self) -> None:
        self.queue: WeightGradQueue | None = None


class _DeferrableLinear(torch.autograd.Function):
    """y = x W^T + b (or x W + b for a transposed weight) for 2-D x; backward defers the weight and bias gradients when the
    slot holds a queue."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None, slot: DeferralSlot, transposed: bool) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.slot, ctx.transposed, ctx.params = slot, transposed, (weight, bias)  # the Parameter objects, whose .grad W adds to
        return gemm.product(x, weight, bias, transposed)  # by the library train.gemm chose, as a plain linear's

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor):
        x, weight = ctx.saved_tensors
        w = weight.to(g.dtype)
        grad_x = gemm.mm(g, w.t() if ctx.transposed else w) if ctx.needs_input_grad[0] else None
        queue, (param, bias) = ctx.slot.queue, ctx.params
        if queue is not None:
            queue.defer(functools.partial(linear_weight_grads, param, bias, x, g, ctx.transposed))
            return grad_x, None, None, None, None
        x = x.to(g.dtype)
        grad_w = (gemm.mm(x.t(), g) if ctx.transposed else gemm.mm(g.t(), x)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_b = g.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None


def deferrable_linear(x: torch.Tensor, weight: nn.Parameter, bias: nn.Parameter | None, slot: DeferralSlot, transposed: bool = False) -> torch.Tensor:
    """A linear layer whose weight gradient the slot's current pass may defer (its Function multiplies 2-D rows: its
    output is then no view, and the view made here may be modified in place)."""
    out = weight.shape[1] if transposed else weight.shape[0]
    return _DeferrableLinear.apply(x.reshape(-1, x.shape[-1]), weight, bias, slot, transposed).view(*x.shape[:-1], out)


def make_deferrable(model: nn.Module, transposed: Iterable[str] = ()) -> DeferralSlot:
    """Make every nn.Linear of `model`, every module named in `transposed` (a linear with an [in, out] weight) and
    every layer that supports deferral itself (a `deferral` attribute: the tensor-parallel linears) defer its weight
    gradient through one shared slot."""
    slot, flipped = DeferralSlot(), set(transposed)
    for name, module in model.named_modules():
        if hasattr(module, "deferral"):
            module.deferral = slot
        elif isinstance(module, nn.Linear) or name in flipped:
            module.forward = _forward_of(module, slot, name in flipped)
    return slot


def _forward_of(module: nn.Module, slot: DeferralSlot, transposed: bool):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return deferrable_linear(x, module.weight, getattr(module, "bias", None), slot, transposed)

    return forward
