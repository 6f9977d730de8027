"""The memory budget is honoured: a model whose states are several times offload.max_memory_gb trains with its
peak resident memory (measured: the process's high-water mark) under the budget plus a documented margin, with
float32 and with bf16 parameters (whose budget counts the bf16 unit and gradient beside the float32 shard)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.common import tiny_config
from tests.dist import run_ranks

BUDGET_MB = 48
# What the budget does not cover: torch's own memory touched for the first time during a step (the autograd engine,
# kernels' code pages and workspaces) and the allocator's slack. Measured here at 5-15 MiB over the model's 42 MiB;
# with bf16 parameters on this CPU 15-18 MiB over its 43 MiB (bf16 kernels touch more of their own: one plain PyTorch block
# in bf16 grew the high-water mark ~6 MiB more than in float32, with half the gradient bytes).
MARGIN_MB = 24
MODEL = ["model.n_layer=16", "model.d_model=256", "model.n_head=4", "model.context=64", "train.seq_len=64"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_peak_resident_memory_stays_under_the_budget(dtype, tmp_path):
    got = run_ranks(1, _budget_body, str(tmp_path), dtype)[0]
    assert got["states_mb"] >= 4 * BUDGET_MB, "the model's states must be several times the budget"
    assert got["losses"][1] < got["losses"][0]
    assert got["growth_mb"] <= BUDGET_MB + MARGIN_MB, got


def _status_kb(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+)", Path("/proc/self/status").read_text(), re.M).group(1))


def _budget_body(run_dir: str, dtype: str) -> dict:
    import torch

    from behemoth.config import Config
    from behemoth.engine import build_engine
    from behemoth.models.causal_lm import build_causal_lm
    from behemoth.topology import init_runtime

    cfg = Config.model_validate(
        tiny_config(
            run_dir,
            *MODEL,
            "train.global_batch=2",
            "train.micro_batch=1",
            "offload.params=disk",
            "offload.grads=disk",
            "offload.optimizer=disk",
            f"offload.max_memory_gb={BUDGET_MB / 1024}",
            f"parallel.param_dtype={dtype}",
        )
    )
    rt = init_runtime(timeout_s=60)
    build_causal_lm(cfg.model, cfg.hf)  # torch's one-time set-up for building modules (tens of MiB) is not the run's memory
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(0))
    batch = [(tokens[i : i + 1, :-1], tokens[i : i + 1, 1:]) for i in range(2)]
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from here
    base = _status_kb("VmRSS")
    engine = build_engine(cfg, rt)
    losses = [engine.train_step(batch, lr=1e-3).loss for _ in range(3)]
    engine.evaluate(batch)
    growth = (_status_kb("VmHWM") - base) / 1024
    states = sum(s.shard_size for s in engine.model.syncs[0].stores) * 16 / 2**20
    engine.close()
    rt.close()
    return {"growth_mb": growth, "states_mb": states, "losses": losses, "prefetch": engine.model.syncs[0].prefetch}
