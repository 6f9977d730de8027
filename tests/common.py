"""Shared pieces of the tests: a tiny config and a training body that reports losses and weights."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

CACHE = Path(tempfile.gettempdir()) / "behemoth-test-cache"


def tiny_config(run_dir: str | Path, *overrides: str) -> dict[str, Any]:
    """A ~40K-parameter GPT on the stdlib corpus; 12 steps of 8 sequences of 32 tokens."""
    from behemoth.config import load_config

    base = [
        "model=gpt-tiny",
        "train.steps=12",
        "train.global_batch=8",
        "train.seq_len=32",
        "train.lr=3e-3",
        "train.warmup_steps=2",
        "train.eval_every=6",
        "train.eval_batches=1",
        "train.log_every=4",
        "train.peak_tflops=1",
        "checkpoint.every=0",
        "run.progress=false",
        "run.tensorboard=false",  # tests/test_profile_tensorboard.py turns it on; the command line's runs keep the default
        "run.timeout_s=60",
        f"run.dir={run_dir}",
        f"data.cache_dir={CACHE}",
    ]
    return load_config(None, base + list(overrides)).model_dump(mode="json")


def train_body(cfg_dict: dict[str, Any], resume: str | None = None) -> dict[str, Any]:
    """Train under the current process group; every rank returns its losses, rank 0 its weights."""
    import torch.distributed as dist

    from behemoth.config import Config
    from behemoth.topology import init_runtime
    from behemoth.train import Trainer

    cfg = Config.model_validate(cfg_dict)
    rt = init_runtime(timeout_s=cfg.run.timeout_s, **cfg.parallel.degrees())
    trainer = Trainer(cfg, rt, resume=Path(resume) if resume else None)
    summary = trainer.run()
    weights = full_weights(trainer) if dist.get_rank() == 0 else None
    return {"losses": summary["losses"], "val": summary["val"], "weights": weights, "start": trainer.start_step}


def full_weights(trainer: Any) -> dict[str, torch.Tensor]:
    """The single-process view of the model's weights (read back from the exported file; an offloaded run, which exports
    only when asked, is exported from its final checkpoint here)."""
    from safetensors.torch import load_file

    from behemoth.faults.checkpoint import export_safetensors, resolve_checkpoint
    from behemoth.models.causal_lm import build_causal_lm

    path = Path(trainer.run_dir) / "model.safetensors"
    if not path.exists():
        export_safetensors(resolve_checkpoint(trainer.run_dir), path, build_causal_lm(trainer.cfg.model, trainer.cfg.hf).module)
    return load_file(str(path))


# An expert weight whose first gradient is float32 noise (gpt-moe-tiny: expert 2's w_in[12, 6] at 3.4e-10, where the
# median element's is 3.5e-4) takes Adam's first step as lr * g / (|g| + eps), whose size follows the noise: 1.9-2.3e-5
# apart between one process and ep x dp ZeRO-3 here and on CI, where the dense floor allows 2e-5. MoE comparisons allow
# 5e-5; a 0.1% change of train.lr moves that model's expert weights by 7.4e-4 beyond the relative part, 15x this floor.
MOE_WEIGHT_ATOL = 5e-5


def assert_close_runs(
    ref: dict[str, Any], got: dict[str, Any], *, loss_rtol: float = 1e-5, weight_rtol: float = 1e-4, weight_atol: float = 1e-5
) -> None:
    """Per-step losses within `loss_rtol`; every final weight within `weight_rtol` of its tensor's scale.

    The small absolute floor is for the attention key bias: its gradient is analytically zero, so
    it holds float32 noise that Adam normalizes into steps; a real bug moves weights by ~1e-3.
    """
    assert len(ref["losses"]) == len(got["losses"]) and ref["losses"]
    for step, (a, b) in enumerate(zip(ref["losses"], got["losses"]), 1):
        assert abs(a - b) <= loss_rtol * abs(a), f"step {step}: loss {b!r} vs reference {a!r}"
    assert ref["weights"].keys() == got["weights"].keys()
    for name, a in ref["weights"].items():
        b = got["weights"][name]
        err = (a - b).abs().max().item()
        scale = a.abs().max().item() + 1e-12
        assert err <= weight_rtol * scale + weight_atol, f"{name}: max |diff| {err:.3g} > {weight_rtol} x {scale:.3g} + {weight_atol}"
