"""torch's AdamW kernels behind behemoth's optimizers: foreach equals the for-loop bit for bit, fused within a few float32
ulps, for the replicated optimizer (data parallelism) and ZeRO's sharded step alike; and which kernel a device gets."""

from __future__ import annotations

import pytest
import torch

from behemoth.parallel.sync import AdamWSettings, adamw_with_state
from behemoth.parallel.zero.adam import AdamFP32, ShardPiece

SHAPES = [(64, 32), (32,), (100, 7), (5,)]  # matrices decay, biases and norms do not
STEPS = 3


def _problem() -> tuple[list[torch.nn.Parameter], list[list[torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(STEPS)]
    return params, grads


def _replicated(kernel: str) -> list[torch.Tensor]:
    """Parameters and both moments after STEPS steps of the replicated optimizer's AdamW."""
    params, grads = _problem()
    opt = adamw_with_state([p for p in params if p.dim() > 1], [p for p in params if p.dim() == 1], AdamWSettings(1e-2, (0.9, 0.95), 0.1, kernel))
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g
        opt.step()
    return [p.detach() for p in params] + [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]


def _sharded(kernel: str) -> list[torch.Tensor]:
    """The same steps by ZeRO's AdamFP32 over one flat shard holding every parameter."""
    params, grads = _problem()
    flat = torch.cat([p.detach().flatten() for p in params])
    sizes = [p.numel() for p in params]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    pieces = [ShardPiece(o, n, len(s) > 1) for o, n, s in zip(offsets, sizes, SHAPES)]
    state = {"m": torch.zeros_like(flat), "v": torch.zeros_like(flat)}
    adam = AdamFP32(AdamWSettings(1e-2, (0.9, 0.95), 0.1, kernel))
    for step, step_grads in enumerate(grads, 1):
        adam.step(flat, torch.cat([g.flatten() for g in step_grads]), state, pieces, lr=1e-2, coef=1.0, step=step)
    moments = [state[k][pc.offset : pc.offset + pc.numel].view(s) for pc, s in zip(pieces, SHAPES) for k in ("m", "v")]
    return [t.view(s) for t, s in zip(flat.split(sizes), SHAPES)] + moments


@pytest.mark.parametrize("run", [_replicated, _sharded])
def test_kernels_equal_the_for_loop(run):
    reference = _replicated("for-loop")  # torch.optim.AdamW's single-tensor loop is the reference of both optimizers
    foreach, fused = run("foreach"), run("fused")
    for i, (ref, a, b) in enumerate(zip(reference, foreach, fused)):
        assert torch.equal(a, ref), f"tensor {i}: foreach differs from the for-loop by {(a - ref).abs().max().item():.3g}"
        torch.testing.assert_close(b, ref, rtol=1e-6, atol=1e-7, msg=lambda m, i=i: f"tensor {i}, fused: {m}")  # a few ulps
    assert not torch.equal(reference[0], _problem()[0][0].detach())  # the steps moved the weights


def test_a_wrong_step_would_be_caught():
    reference = _replicated("for-loop")
    params, grads = _problem()
    opt = adamw_with_state([p for p in params if p.dim() > 1], [p for p in params if p.dim() == 1], AdamWSettings(1e-2, (0.9, 0.95), 0.1001, "fused"))
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g
        opt.step()
    with pytest.raises(AssertionError):
        torch.testing.assert_close(params[0].detach(), reference[0], rtol=1e-6, atol=1e-7)  # weight decay 0.1001 instead of 0.1


def test_kernel_per_device():
    from behemoth.config import load_config
    from behemoth.engine import adamw_kernel

    train = load_config(None, ["model=gpt-tiny"]).train
    assert adamw_kernel(train, torch.device("cuda")) == "fused" and adamw_kernel(train, torch.device("cpu")) == "fused"
    chosen = load_config(None, ["model=gpt-tiny", "train.adamw=for-loop"]).train
    assert adamw_kernel(chosen, torch.device("cuda")) == "for-loop"
