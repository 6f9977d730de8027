"""A burst plan executes equal to single process: losses, first-step gradients and weights after SGD steps (float32).

SGD with momentum, not Adam: a key bias's gradient is zero in exact arithmetic, and Adam's g / sqrt(v) would turn its
last-bit noise into full-size steps of either sign; a linear update keeps the comparison at float32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks

STEPS, SEQ = 3, 16


FAMILIES = {
    "gpt": ["model=gpt-tiny", "model.tie_embeddings=true"],  # the head reads the embedding: one weight, two groups
    "llama": ["model=gpt-tiny", "model=hf:llama", "model.n_head=4", "hf.kv_heads=2", "hf.ffn=64"],  # rotary, GQA, untied
}


def _batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (batch, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _model(family: str):
    from behemoth.config import load_config
    from behemoth.models.causal_lm import build_causal_lm
    from behemoth.models.init import materialize

    cfg = load_config(None, [*FAMILIES[family], "model.n_layer=3", f"model.context={SEQ}"])
    lm = build_causal_lm(cfg.model, cfg.hf)
    materialize(lm.module, seed=0, device=torch.device("cpu"), init_spec=lm.init_spec)
    return lm


def train_body(widths: tuple[int, ...] | None, batch: int, family: str = "gpt", sync: bool = True, overlap: bool = False) -> dict:
    """STEPS SGD steps of a tiny model: single process when `widths` is None, else the burst plan `widths`."""
    import torch.distributed as dist

    from behemoth.models.causal_lm import counted_targets, summed_token_loss
    from behemoth.parallel.burst import BurstGroups, BurstModel

    lm = _model(family)
    model = lm.module
    burst = None
    if widths is not None:
        burst = BurstModel(lm, widths, BurstGroups.of(widths, dist.group.WORLD, torch.device("cpu")), batch=batch, overlap=overlap)
        if not sync:
            burst.sync_gradients = lambda: None
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses, grads = [], {}
    for step in range(STEPS):
        x, y = _batch(step, batch)
        if burst is None:
            loss_t = summed_token_loss(lm.logits(x), y) / counted_targets(y)
            loss_t.backward()
            loss = float(loss_t.detach())
        else:
            loss = burst.step(x, y)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss)
    held = set(grads)
    return {"losses": losses, "grads": grads, "weights": {n: p.detach().clone() for n, p in model.named_parameters() if n in held}}


@pytest.fixture(scope="module")
def reference():
    return {(f, b): train_body(None, b, f) for f, b in (("gpt", 5), ("gpt", 6), ("llama", 5))}  # no process group needed


def assert_equal_to_reference(ref: dict, ranks: list[dict]) -> None:
    for r, got in enumerate(ranks):
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), f"rank {r} losses"
        assert got["grads"], f"rank {r} holds no gradient"
        for name, g in got["grads"].items():
            torch.testing.assert_close(g, ref["grads"][name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name, r=r: f"rank {r} {n}: {m}")
        for name, w in got["weights"].items():
            torch.testing.assert_close(w, ref["weights"][name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name, r=r: f"rank {r} {n}: {m}")
    assert set(ranks[0]["grads"]) == set(ref["grads"]), "rank 0 is in every group: it must hold every gradient"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_burst_plan_on_two_ranks_equals_single_process(reference, family):
    """Embedding on one rank, blocks on 2 then 1 then 2, head on 2 (a tied embedding summed over 2); batch 5 splits 2 + 3."""
    got = run_ranks(2, train_body, (1, 2, 1, 2, 2), 5, family)
    assert_equal_to_reference(reference[family, 5], got)
    block = {"gpt": "blocks.1.", "llama": "model.layers.1."}[family]
    assert all(not n.startswith(block) for n in got[1]["grads"]), "rank 1 is outside block 1's group"


def test_overlapped_gradient_sums_equal_single_process(reference):
    """Each layer's gradient sums started as its backward ends (beside the earlier layers' backward), finished after:
    the same plan (a tied embedding summed over the head's 2 ranks once the embedding's backward ends) as above."""
    assert_equal_to_reference(reference["gpt", 5], run_ranks(2, train_body, (1, 2, 1, 2, 2), 5, "gpt", True, True))


def test_missing_gradient_sync_would_be_caught(reference):
    got = run_ranks(2, train_body, (2, 2, 2, 2, 2), 6, "gpt", False)
    with pytest.raises(AssertionError):
        assert_equal_to_reference(reference["gpt", 6], got)


@pytest.mark.slow
@pytest.mark.parametrize("widths", [(2, 4, 1, 3, 4), (4, 4, 4, 4, 4), (1, 1, 4, 2, 3)])
def test_burst_plan_on_four_ranks_equals_single_process(reference, widths):
    assert_equal_to_reference(reference["gpt", 6], run_ranks(4, train_body, widths, 6))


def test_bad_widths_are_refused():
    from behemoth.errors import BehemothError
    from behemoth.parallel.burst import check_widths

    with pytest.raises(BehemothError, match="5 widths for 4 layers"):
        check_widths((1, 1, 1, 1, 1), 2, 2, 4)
    with pytest.raises(BehemothError, match=r"\[3\] outside 1..2"):
        check_widths((1, 3, 1, 1), 2, 4, 2)
