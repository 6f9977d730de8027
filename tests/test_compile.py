"""train.compile=true (each block compiled by torch.compile) trains the eager curve, alone and under every layout it
composes with; compilation is reported apart from step time and cached between runs.

Compiling takes tens of seconds per graph on 2 cores (46 s for the one-layer test from an empty cache in a fresh-clone
CI run), so every compiled run is slow-marked and the default run holds only where the cache goes:
`OMP_NUM_THREADS=1 python -m pytest -q -m slow tests/test_compile.py` runs the one-layer model of 16 tokens and every layout.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.common import CACHE, assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks

SMALL = ("model.n_layer=1", "train.seq_len=16", "train.steps=3", "train.global_batch=4", "train.eval_batches=1", "train.eval_every=0")
# float32 reassociation: inductor fuses and reorders sums (layer norm, softmax, gelu), as other layouts do: the layouts' tolerances
LOSS_RTOL, WEIGHT_RTOL = 1e-5, 1e-4


def _runs(tmp_path, *overrides: str, world: int = 1) -> tuple[dict, dict]:
    eager = run_ranks(world, train_body, tiny_config(tmp_path / "eager", *SMALL, *overrides))[0]
    compiled_cfg = tiny_config(tmp_path / "compiled", *SMALL, *overrides, "train.compile=true", "run.timeout_s=600")  # a rank may wait
    compiled = run_ranks(world, train_body, compiled_cfg, timeout=900)[0]  # for another's compilation (minutes on a loaded machine)
    return eager, compiled


def _records(run_dir) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.mark.slow
def test_compiled_blocks_train_the_eager_curve(tmp_path):
    """One process: same losses and weights as eager within float32 reassociation; the first step's compilation is
    reported apart from its step time, later steps compile nothing."""
    eager, compiled = _runs(tmp_path)
    assert_close_runs(eager, compiled, loss_rtol=LOSS_RTOL, weight_rtol=WEIGHT_RTOL)
    _compiled_once(tmp_path / "compiled")
    first = _records(tmp_path / "compiled")[0]  # a tiny step takes milliseconds, its compilation seconds: not counted in it
    assert first["step_time_s"] < first["compile_s"], first
    assert "compile_s" not in _records(tmp_path / "eager")[0]
    assert os.listdir(CACHE / "inductor"), "inductor's cache stayed empty"


LAYOUTS = {
    "dp": ("parallel.dp=2",),
    "zero3": ("parallel.dp=2", "parallel.zero_stage=3", "train.micro_batch=1"),
    "zero3-recompute": ("parallel.dp=2", "parallel.zero_stage=3", "parallel.recompute=full"),
    "tp": ("parallel.tp=2",),
    "tp-sp": ("parallel.tp=2", "parallel.sequence_parallel=true"),
    "pp": ("model.n_layer=2", "parallel.pp=2", "parallel.schedule=1f1b", "train.micro_batch=1"),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_compiled_blocks_compose_with_layouts(layout, tmp_path):
    """Two processes: compiled blocks under data parallelism, ZeRO-3's gathers (with recomputation), tp's collectives
    (graph breaks), a pipeline: the eager run of the same layout, within the same tolerance, compiled in the first step only."""
    eager, compiled = _runs(tmp_path, *LAYOUTS[layout], world=2)
    assert_close_runs(eager, compiled, loss_rtol=LOSS_RTOL, weight_rtol=WEIGHT_RTOL)
    _compiled_once(tmp_path / "compiled")


def _compiled_once(run_dir) -> None:
    """The first step compiled (rank 0's blocks really ran compiled) and no later step recompiled."""
    steps = [s["compile_s"] for s in _records(run_dir)]
    assert steps[0] > 0 and all(s == 0 for s in steps[1:]), steps


@pytest.mark.slow
def test_compiled_blocks_with_recomputation_and_offload(tmp_path):
    """One process: recomputation checkpoints the compiled forward; offload's streamer runs and recomputes it."""
    eager, compiled = _runs(tmp_path, "parallel.recompute=full")
    assert_close_runs(eager, compiled, loss_rtol=LOSS_RTOL, weight_rtol=WEIGHT_RTOL)
    _compiled_once(tmp_path / "compiled")
    eager, compiled = _runs(tmp_path / "offload", "offload.params=host")
    assert_close_runs(eager, compiled, loss_rtol=LOSS_RTOL, weight_rtol=WEIGHT_RTOL)
    _compiled_once(tmp_path / "offload" / "compiled")


@pytest.mark.parametrize(
    "overrides, reason",
    [(("model=gpt-moe-tiny",), "mixture-of-experts"), (("parallel.tp=2",), None), (("parallel.dp=2", "parallel.zero_stage=3"), None)],
)
def test_layouts_compile_cannot_serve_are_refused_before_launch(overrides, reason):
    """MoE (data-dependent shapes) is refused with the reason; tensor parallelism and ZeRO-3 are not."""
    from behemoth.config import load_config
    from behemoth.planner.feasibility import problems

    found = [p.message for p in problems(load_config(None, [*overrides, "train.compile=true"]), 2) if p.option == "train.compile"]
    assert (found == []) if reason is None else (len(found) == 1 and reason in found[0] and "train.compile=false" in found[0]), found


@pytest.mark.parametrize("user_setting", [None, "mine"])
def test_compile_cache_is_behemoths_unless_the_user_chose_one(tmp_path, user_setting):
    """Importing torch._dynamo writes torch's default (a temp folder) into TORCHINDUCTOR_CACHE_DIR; that is not the
    user's choice, so the cache stays under BEHEMOTH_CACHE; a folder the user names wins."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"} | {"BEHEMOTH_CACHE": str(tmp_path / "cache")}
    if user_setting:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / user_setting)
    code = "import torch._dynamo\nfrom behemoth.parallel.compile import use_compile_cache\nprint(use_compile_cache())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    expected = tmp_path / user_setting if user_setting else tmp_path / "cache" / "inductor"
    assert out.stdout.strip() == str(expected) and expected.is_dir(), out.stdout + out.stderr


def test_launched_workers_do_not_take_torchs_default_cache_for_the_users(tmp_path, monkeypatch):
    """The launcher gives workers their own TMPDIR, under which torch's default (inherited from the parent) no longer
    looks like a default: it is dropped for the launch and restored after."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from behemoth.faults.elastic import local_launch_env
    from behemoth.parallel.compile import compile_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    monkeypatch.setenv("BEHEMOTH_CACHE", str(tmp_path))
    with local_launch_env(1):
        assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ and compile_cache_dir() == tmp_path / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir()
