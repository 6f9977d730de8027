"""Unmodified Hugging Face Llama, Mistral, Qwen2, Gemma and Qwen3 under 3-D tensor parallelism (parallel.tp_mode=3d, a 2 x 2 x 2 cube on
8 gloo ranks) equal the single process, starting from the same save_pretrained folder.

The default suite keeps one 8-rank Llama run: its summed loss and every parameter's gradient against plain transformers,
and a control with a bug (RoPE positions restarting halfway on the cube's t=1 half) that must fail that comparison.
Training 3 steps (losses and exported weights against the single-process run) for each family is slow-marked: 8
processes on 2 cores.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.common import assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks
from tests.test_hf_tensor_2d import STEPS, check_gradients, save_tiny

pytest.importorskip("transformers")

CUBE = ["parallel.tp=8", "parallel.tp_mode=3d"]


def _gradients_3d(cfg_dict: dict[str, Any]) -> dict[str, float]:
    return check_gradients(cfg_dict, "3d")


def _cube_body(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """On 8 ranks: the gradient check, then training (one spawn for both)."""
    return {**_gradients_3d(cfg_dict), "run": train_body(cfg_dict)}


def _check_control(results: list[dict[str, Any]], floor: float = 1e-3) -> None:
    for r in results:
        assert r["bug_err"] > floor, f"the control (wrong RoPE positions on half the cube) would pass: {r['bug_err']:.2g}"


def test_hf_llama_tp3d_gradients_equal_single_process(tmp_path):
    """One batch's summed loss (1e-5) and every gradient (1e-4 of its scale) of Llama on the cube against transformers in
    one process; the RoPE control misses the loss by far more than the tolerance."""
    folder = tmp_path / "weights"
    save_tiny("llama", folder)
    got = run_ranks(8, _gradients_3d, tiny_config(tmp_path / "3d", f"hf.weights={folder}", *CUBE), timeout=300)
    _check_control(got)
    assert all(r["grads"] == got[0]["grads"] for r in got)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma", "qwen3"])
def test_hf_tp3d_training_equals_single_process(tmp_path, arch):
    """Gradients of one batch, then 3 training steps on the cube (losses 1e-5, exported weights 1e-4) against one
    process, from the same save_pretrained folder (Qwen2's q/k/v biases cut in q^3, Mistral's sliding window, Gemma's
    (1 + w) norms, scaled embeddings and GeGLU, Qwen3's per-head q/k norms held whole and summed over the cube)."""
    folder = tmp_path / "weights"
    save_tiny(arch, folder)
    ref = run_ranks(1, train_body, tiny_config(tmp_path / "ref", f"hf.weights={folder}", *STEPS))[0]
    got = run_ranks(8, _cube_body, tiny_config(tmp_path / "3d", f"hf.weights={folder}", *STEPS, *CUBE), timeout=500)
    _check_control(got, 1e-4 if arch == "qwen3" else 1e-3)  # Qwen3's q/k norms damp the RoPE control (7e-4 under 2-D)
    assert_close_runs(ref, got[0]["run"])
    assert all(r["run"]["losses"] == got[0]["run"]["losses"] for r in got), "cube ranks disagree on the loss"


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["hf.kv_heads=1"], "does not split hf.kv_heads=1 (by 2)"),
        (["hf.ffn=68"], "the MLP width=68 (by 8)"),
        (["model=hf:phi3"], "hf phi3 has no 3-D plan"),
        (["model=hf:gpt2", "hf.kv_heads=4"], "hf gpt2 has no 3-D plan"),
        (["train.global_batch=2"], "a micro-batch has 2"),
    ],
)
def test_hf_tp3d_refused_before_launch(tmp_path, overrides, message):
    from behemoth.config import Config
    from behemoth.planner.feasibility import problems

    base = ["model=hf:llama", "model.n_head=4", "hf.kv_heads=2", "hf.ffn=64", *CUBE]
    cfg = Config.model_validate(tiny_config(tmp_path, *base, *overrides))
    found = " | ".join(p.message for p in problems(cfg, 8))
    assert message in found, found
