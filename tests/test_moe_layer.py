"""The MoE layer on one process: capacity and dropping by their definitions, and the layer against a plain loop."""

from __future__ import annotations

import math

import pytest
import torch

from behemoth.models.gpt import GPTConfig, moe_mlp
from behemoth.models.init import InitSpec, materialize
from behemoth.models.moe import RouterStats
from behemoth.models.routing import RoutingPolicy, expert_capacity, route
from tests.moe_reference import assert_close_scaled, capacity_by_definition, reference_moe


@pytest.mark.parametrize("tokens,experts,k,factor", [(16, 4, 2, 1.0), (16, 4, 2, 0.3), (100, 8, 1, 1.25), (7, 3, 2, 2.0), (64, 64, 1, 0.1)])
def test_capacity_definitions(tokens: int, experts: int, k: int, factor: float) -> None:
    """DeepSpeed: max(ceil(k T / E f), min_capacity); Tutel: k floor(f ceil(T / E))."""
    assert expert_capacity(tokens, experts, k, factor, "deepspeed", 4) == max(math.ceil(k * tokens / experts * factor), 4)
    assert expert_capacity(tokens, experts, k, factor, "deepspeed", 0) == math.ceil(k * tokens / experts * factor)
    assert expert_capacity(tokens, experts, k, factor, "tutel") == k * math.floor(factor * math.ceil(tokens / experts))


def crafted_logits(groups: int, tokens: int, experts: int) -> torch.Tensor:
    """Every token prefers expert 0, then 1, then 2...: all first choices land on one expert."""
    return torch.arange(experts, 0, -1, dtype=torch.float32).expand(groups, tokens, experts).clone()


@pytest.mark.parametrize(
    "definition,factor,min_capacity,expected",
    [("deepspeed", 0.5, 4, 4), ("deepspeed", 0.3, 4, 4), ("deepspeed", 0.3, 0, 3), ("tutel", 0.5, 0, 4), ("tutel", 0.3, 0, 2)],
)
def test_all_tokens_to_one_expert(definition: str, factor: float, min_capacity: int, expected: int) -> None:
    """16 tokens, 4 experts, top-2, all choosing experts 0 then 1: each keeps its first C assignments, in token order."""
    policy = RoutingPolicy(2, factor, capacity_def=definition, min_capacity=min_capacity)
    r = route(crafted_logits(2, 16, 4), policy, training=True)
    assert r.capacity == expected == capacity_by_definition(16, 4, 2, factor, definition, min_capacity)
    assert (r.experts[..., 0] == 0).all() and (r.experts[..., 1] == 1).all()
    assert r.slots[0, :, 0].tolist() == list(range(16)) and r.slots[0, :, 1].tolist() == list(range(16))
    assert r.kept[:, :expected].all() and not r.kept[:, expected:].any()
    assert r.expert_counts(4).tolist() == [2 * expected, 2 * expected, 0, 0]


def test_second_choices_queue_after_first_choices() -> None:
    """An expert's slots go to every first choice of the group before any second choice (GShard's priority)."""
    logits = torch.zeros(1, 4, 3)
    logits[0, :2] = torch.tensor([3.0, 2.0, 1.0])  # tokens 0, 1: expert 0, then 1
    logits[0, 2:] = torch.tensor([2.0, 3.0, 1.0])  # tokens 2, 3: expert 1, then 0
    r = route(logits, RoutingPolicy(2, 0.75, min_capacity=0), training=True)  # C = ceil(2 * 4 / 3 * 0.75) = 2
    assert r.capacity == 2
    assert r.kept[0, :, 0].all() and not r.kept[0, :, 1].any()  # the first choices fill both experts' two slots


def moe_layer(k: int, factor: float | None, group: int | None, definition: str = "deepspeed", aux: str = "switch", normalize: str = "chosen"):
    cfg = GPTConfig(
        preset="gpt-moe-tiny",
        moe=dict(
            top_k=k,
            capacity_factor=factor,
            group=group,
            capacity=definition,
            aux_loss=aux,
            min_capacity=2,
            aux_coef=0.1,
            z_coef=0.01,
            normalize=normalize,
        ),
    )
    stats = RouterStats([4])
    with torch.device("meta"):
        layer = moe_mlp(cfg, 4, 0, stats)
    materialize(layer, seed=3, device=torch.device("cpu"), init_spec=lambda name: InitSpec("normal", 0.3))
    return layer, stats


CASES = [
    (1, None, 1, "deepspeed", "chosen"),
    (2, None, None, "deepspeed", "chosen"),
    (1, 1.0, 1, "deepspeed", "chosen"),
    (2, 0.5, 1, "deepspeed", "chosen"),
    (2, 0.5, 1, "deepspeed", "kept"),
    (2, 0.75, None, "tutel", "chosen"),
    (3, 1.0, 2, "tutel", "none"),
]


@pytest.mark.parametrize("k,factor,group,definition,normalize", CASES)
def test_layer_matches_plain_loop(k: int, factor: float | None, group: int | None, definition: str, normalize: str) -> None:
    """Output, auxiliary losses, dropped assignments and every gradient equal the plain-loop reference (float32)."""
    layer, stats = moe_layer(k, factor, group, definition, aux="topk" if k == 3 else "switch", normalize=normalize)
    layer.train()
    x = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    probe = torch.randn(4, 8, 32, generator=torch.Generator().manual_seed(2))
    (layer(x) * probe).sum().backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()} | {"x": x.grad.clone()}

    params = {n: p.detach().clone().requires_grad_(True) for n, p in layer.named_parameters()}
    xr = x.detach().clone().requires_grad_(True)
    out, aux_sum, z_sum, kept = reference_moe(
        xr,
        params["router.weight"],
        params["experts.w_in"],
        params["experts.w_out"],
        k=k,
        factor=factor,
        group=group,
        definition=definition,
        min_capacity=2,
        aux="topk" if k == 3 else "switch",
        normalize=normalize,
    )
    ((out * probe).sum() + 0.1 * aux_sum + 0.01 * z_sum).backward()
    want = {n: p.grad for n, p in params.items()} | {"x": xr.grad}

    summary = stats.summary(stats.packed(torch.device("cpu")))
    assert summary["dropped_fraction"] == pytest.approx(kept.count(False) / len(kept))
    assert summary["aux_loss"] == pytest.approx(float(aux_sum.detach()) / 32, rel=1e-5)
    assert summary["z_loss"] == pytest.approx(float(z_sum.detach()) / 32, rel=1e-5)
    if factor is not None and k > 1:
        assert kept.count(False) > 0  # the capacity cases really drop tokens
    for name, g in want.items():
        assert_close_scaled(got[name], g, name)


def test_dropped_tokens_pass_through_unchanged() -> None:
    """A token all of whose choices are dropped gets no expert output: the MoE MLP adds zero, the residual carries it."""
    layer, _ = moe_layer(2, 1.0, 1)  # C = max(ceil(2 * 8 / 4 * 1.0), 2) = 4 slots per expert for the 8 tokens of a sequence
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:2, 0] = torch.tensor([2.0, 1.0])  # every token: expert 0, then expert 1
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(4))
    x[..., 0] = 1.0
    out = layer.train()(x)
    assert out[:, 4:].abs().max() == 0  # tokens 4-7 of each sequence: both choices past capacity
    assert out[:, :4].abs().min(dim=-1).values.gt(0).all()


@pytest.mark.parametrize("noise", ["jitter", "gumbel"])
def test_noisy_gating_only_while_training(noise: str) -> None:
    """Noisy gating changes some choices while training (from the process RNG, like dropout), none at evaluation."""
    from behemoth.models.routing import route

    torch.manual_seed(0)
    cfg = GPTConfig(preset="gpt-moe-tiny", moe=dict(noise=noise, noise_eps=0.5))
    with torch.device("meta"):
        layer = moe_mlp(cfg, 4, 0, RouterStats([4]))
    materialize(layer, seed=3, device=torch.device("cpu"), init_spec=lambda name: InitSpec("normal", 0.3))
    tokens = torch.randn(256, 32, generator=torch.Generator().manual_seed(5))
    clean = route(layer.eval().router_logits(tokens).view(1, -1, 4), layer.policy, training=False).experts
    noisy = route(layer.train().router_logits(tokens).view(1, -1, 4), layer.policy, training=True).experts
    again = route(layer.eval().router_logits(tokens).view(1, -1, 4), layer.policy, training=False).experts
    assert torch.equal(clean, again) and not torch.equal(clean, noisy)
    assert (clean != noisy).float().mean() < 0.5  # noise perturbs the routing, it does not replace it
