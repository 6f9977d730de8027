"""Deferred weight gradients (zero-bubble's split backward): the input pass gives exactly the input gradient and
every gradient that is not a linear layer's; the weight pass adds the linear layers' weight and bias gradients;
together they equal one ordinary backward, for nn.Linear and for a transposed ([in, out]) linear."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from behemoth.parallel.deferred import WeightGradQueue, linear_weight_grads, make_deferrable


class Transposed(nn.Module):
    """A linear layer holding its weight as [in, out] (as GPT-2's Conv1D does)."""

    def __init__(self, n_in: int, n_out: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out))
        self.bias = nn.Parameter(torch.randn(n_out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight
        return y if self.bias is None else y + self.bias


@pytest.mark.parametrize("bias", [True, False])
def test_input_pass_then_weight_pass_equals_one_backward(bias):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=bias), nn.LayerNorm(16), Transposed(16, 12, bias), nn.GELU(), nn.Linear(12, 4, bias=bias))
    split = copy.deepcopy(model)
    slot = make_deferrable(split, transposed={"2"})
    x = torch.randn(3, 5, 8)
    probe = torch.randn(3, 5, 4)
    leaf, split_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
    (model(leaf) * probe).sum().backward()
    queue = slot.queue = WeightGradQueue()
    (split(split_leaf) * probe).sum().backward()
    slot.queue = None
    torch.testing.assert_close(split_leaf.grad, leaf.grad, rtol=0, atol=0)
    linear = {n for n, p in split.named_parameters() if not n.startswith("1.")}
    assert all(p.grad is None for n, p in split.named_parameters() if n in linear), "the input pass computed a weight gradient"
    assert all(p.grad is not None for n, p in split.named_parameters() if n not in linear), "the norm's gradients belong to the input pass"
    queue.run()
    assert not queue.items
    for (name, a), (_, b) in zip(model.named_parameters(), split.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_without_a_queue_a_deferrable_layer_is_an_ordinary_linear():
    torch.manual_seed(1)
    plain = nn.Linear(6, 5)
    deferrable = copy.deepcopy(plain)
    make_deferrable(deferrable)
    x = torch.randn(4, 6)
    torch.testing.assert_close(deferrable(x), plain(x), rtol=0, atol=0)
    deferrable(x).square().sum().backward()
    plain(x).square().sum().backward()
    for a, b in zip(plain.parameters(), deferrable.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7)
    existing = deferrable.weight.grad  # a gradient that exists already (a bucket view) is added to, not replaced
    queue = WeightGradQueue()
    queue.defer(lambda: linear_weight_grads(deferrable.weight, None, x, torch.ones(4, 5), False))
    queue.run()
    assert deferrable.weight.grad is existing


def test_deferrable_layers_multiply_with_the_library_training_chose(monkeypatch):
    """Under train.gemm=onednn a deferrable linear runs its forward, input-gradient and deferred weight-gradient products
    by oneDNN, as the routed linears of every other schedule do (a zero-bubble stage on BLAS ran 1.6x slower here), and
    its gradients are the routed layer's."""
    from behemoth.models import gemm

    if not gemm.onednn_available():
        pytest.skip("this torch has no oneDNN")
    calls = []
    real = gemm._dnn
    monkeypatch.setattr(gemm, "_dnn", lambda *a: calls.append(a[0].shape) or real(*a))
    monkeypatch.setattr(gemm._Choice, "mode", "onednn")
    torch.manual_seed(2)
    routed = nn.Sequential(nn.Linear(8, 16), nn.GELU(), Transposed(16, 4, bias=True))
    split = copy.deepcopy(routed)
    routed[0].__class__ = gemm.GemmLinear
    routed[2].forward = lambda x: gemm.linear_transposed(x, routed[2].weight, routed[2].bias)
    slot = make_deferrable(split, transposed={"2"})
    x, probe = torch.randn(3, 5, 8), torch.randn(3, 5, 4)
    leaf, split_leaf = x.clone().requires_grad_(), x.clone().requires_grad_()
    (routed(leaf) * probe).sum().backward()
    calls.clear()
    queue = slot.queue = WeightGradQueue()
    out = split(split_leaf)
    assert len(calls) == 2, "forward: one oneDNN product per linear"
    (out * probe).sum().backward()
    slot.queue = None
    assert len(calls) == 2 + 2, "input pass: one oneDNN product per linear"
    queue.run()
    assert len(calls) == 2 + 2 + 2, "weight pass: one oneDNN product per linear"
    torch.testing.assert_close(split_leaf.grad, leaf.grad, rtol=1e-6, atol=1e-6)
    for (name, a), (_, b) in zip(routed.named_parameters(), split.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-6, msg=name)
