"""Unmodified transformers Mixtral under behemoth's MoE layer: transformers' logits, the single-process curve at
ep = 2, weights from and to the save_pretrained layout (per-expert w1 / w2 / w3)."""

from __future__ import annotations

import pytest
import torch

from tests.common import assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks

pytest.importorskip("transformers")

# transformers' pooled load-balancing loss (its counts summed over the ep ranks) trains with a weight of 0.02
MIXTRAL = ["model=hf:mixtral", "model.n_head=4", "hf.kv_heads=2", "hf.ffn=64", "model.moe.experts=4", "model.moe.aux_coef=0.02"]


def built(*overrides: str):
    from behemoth.config import load_config
    from behemoth.models.causal_lm import build_causal_lm
    from behemoth.models.init import materialize

    cfg = load_config(None, ["model=gpt-tiny", *MIXTRAL, *overrides])
    lm = build_causal_lm(cfg.model, cfg.hf)
    materialize(lm.module, seed=1, device=torch.device("cpu"), init_spec=lm.init_spec)
    lm.after_materialize(torch.device("cpu"))
    return cfg, lm


def test_logits_equal_transformers_own_forward() -> None:
    """Dropless routing through behemoth's MoE layer is Mixtral's sparse block: the same logits as transformers."""
    import transformers

    from behemoth.models.hf import transformers_config

    cfg, lm = built()
    ref = transformers.MixtralForCausalLM(transformers_config(cfg.model, cfg.hf)).eval()
    ref.load_state_dict(lm.module.state_dict(), strict=True)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(lm.module.eval()(input_ids=idx).logits, ref(input_ids=idx).logits, rtol=1e-5, atol=1e-6)
    assert lm.moe_layers == ("model.layers.0.mlp", "model.layers.1.mlp")
    assert lm.shape.experts == (4, 4) and lm.shape.top_k == 2


@pytest.fixture(scope="module")
def mixtral_reference(tmp_path_factory):
    return run_ranks(1, train_body, tiny_config(tmp_path_factory.mktemp("mixtral"), *MIXTRAL))[0]


@pytest.mark.parametrize(
    "plan",
    [
        ("parallel.ep=2",),
        ("parallel.ep=2", "parallel.zero_stage=2", "model.moe.capacity_factor=4.0"),
        ("parallel.tp=2", "parallel.sequence_parallel=true"),
    ],
)
def test_mixtral_ep2_matches_single_process(mixtral_reference, tmp_path, plan):
    """Mixtral's experts over 2 ranks (gate_up_proj / down_proj split along the experts) train the single-process curve;
    a capacity that drops nothing (factor 4 of 4 experts) is the dropless curve; under tp=2 with sequence parallelism
    each MoE layer runs on the gathered sequence with its experts' widths split, and its output re-enters the SP region."""
    got = run_ranks(2, train_body, tiny_config(tmp_path, *MIXTRAL, *plan))[0]
    assert_close_runs(mixtral_reference, got)
    assert got["weights"]["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 128, 32)  # consolidated: the full tensor


def test_mixtral_weights_from_and_to_the_hf_layout(tmp_path):
    """hf.weights reads a save_pretrained folder (per-expert tensors), the experts split over ep = 2; `behemoth export --hf`
    writes one back that transformers' from_pretrained loads to the same logits."""
    import transformers

    from behemoth.cli import main
    from behemoth.models.hf import transformers_config

    cfg, _ = built()
    torch.manual_seed(3)
    original = transformers.MixtralForCausalLM(transformers_config(cfg.model, cfg.hf))
    original.save_pretrained(str(tmp_path / "weights"))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "weights" / "model.safetensors"), "pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in f.keys()  # the layout being read
    run = tmp_path / "run"
    run_ranks(
        2,
        train_body,
        tiny_config(
            run,
            f"hf.weights={tmp_path / 'weights'}",
            "model.moe.experts=4",
            "parallel.ep=2",
            "train.steps=2",
            "train.lr=1e-9",
            "train.warmup_steps=0",
        ),
    )
    assert main(["export", str(run), "--hf", str(tmp_path / "exported")]) == 0
    back = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "exported")).eval()
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(back(input_ids=idx).logits, original.eval()(input_ids=idx).logits, rtol=1e-3, atol=1e-4)
