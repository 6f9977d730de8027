"""Context-parallel attention against SDPA on the whole sequence: ring (load-balanced causal chunks) and Ulysses,
forward and backward, with grouped-query K/V heads; and deliberate bugs (a causal mask lost between chunks, a wrong
chunk layout) that the same comparison catches."""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks

B, H, T, D = 2, 4, 32, 8


def _full(kv_heads: int) -> tuple[torch.Tensor, ...]:
    """The whole sequence's q, k, v and output gradient, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, T, D, generator=g)
    k, v = (torch.randn(B, kv_heads, T, D, generator=g) for _ in range(2))
    return q, k, v, torch.randn(B, H, T, D, generator=g)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> list[torch.Tensor]:
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    y = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True)
    y.backward(dout)
    return [y.detach(), q.grad, k.grad, v.grad]


CASES = [
    ("ring", 4, None),
    ("ring", 2, None),
    ("ulysses", 2, None),
    ("ulysses", 1, None),
    ("ring", 2, "no_causal_between_chunks"),
    ("ring", 2, "wrong_layout"),
]


def _sharded(mode: str, kv_heads: int, bug: str | None = None) -> list[float]:
    """This rank's output and q/k/v gradients by `mode`, gathered to whole-sequence tensors; their largest errors
    against the reference's, relative to its largest value."""
    import torch.distributed as dist

    from behemoth.parallel.context import ContextLayout, context_attention
    from behemoth.parallel.context import ring as ring_module

    group = dist.group.WORLD
    layout = ContextLayout(dist.get_world_size(), dist.get_rank(), balanced=mode == "ring")
    step_kind = ring_module._step_kind
    if bug == "no_causal_between_chunks":  # the late chunk attends to the next rank's late chunk too
        ring_module._step_kind = lambda i, j: "diag" if i == j else "late"
    q, k, v, dout = _full(kv_heads)
    mine = [layout.shard(t.transpose(1, 2)).transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    y = context_attention(mode, group)(*mine, scale=None, dropout=0.0)
    y.backward(layout.shard(dout.transpose(1, 2)).transpose(1, 2))
    ring_module._step_kind = step_kind
    unshard = layout if bug != "wrong_layout" else ContextLayout(layout.cp, layout.rank, not layout.balanced)
    errors = []
    for t, ref in zip((y.detach(), *(m.grad for m in mine)), _reference(q, k, v, dout)):
        parts = [torch.empty_like(t) for _ in range(layout.cp)]
        dist.all_gather(parts, t.contiguous(), group=group)
        got = unshard.unshard([p.transpose(1, 2) for p in parts]).transpose(1, 2)
        errors.append(float((got - ref).abs().max() / ref.abs().max()))
    return errors


def _all_cases() -> list[list[float]]:
    return [_sharded(*case) for case in CASES]


@pytest.fixture(scope="module")
def two_rank_errors() -> dict[tuple, list[float]]:
    """Every case's errors on both ranks (one pair of processes for all of them)."""
    ranks = run_ranks(2, _all_cases)
    return {case: [e for r in ranks for e in r[i]] for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: f"{c[0]}-kv{c[1]}")
def test_context_attention_equals_sdpa_on_the_whole_sequence(two_rank_errors: dict, case: tuple) -> None:
    """Output and q/k/v gradients within float32 rounding of SDPA's (ring: K/V heads 4 and 2 of 4; Ulysses: 2 and 1,
    which does not split over 2 ranks and is repeated)."""
    assert max(two_rank_errors[case]) < 1e-5, two_rank_errors[case]


@pytest.mark.parametrize("case", CASES[4:], ids=lambda c: c[2])
def test_a_broken_mask_or_layout_is_caught(two_rank_errors: dict, case: tuple) -> None:
    """The comparison above fails (by far more than its tolerance) when the ring attends across the causal boundary
    between chunks, or when the shards are read back in the wrong chunk order."""
    assert max(two_rank_errors[case]) > 1e-2, two_rank_errors[case]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_context_attention_on_four_ranks(mode: str) -> None:
    for errors in run_ranks(4, _sharded, mode, 2):
        assert max(errors) < 1e-5, errors
