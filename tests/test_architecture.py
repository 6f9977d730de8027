"""The house the capabilities live in: two models training side by side in one world, every reason a plan cannot
run reported at once, and a parallel model built without an optimizer giving the training model's logits."""

from __future__ import annotations

import pytest
import torch

from tests.common import CACHE, assert_close_runs, full_weights, tiny_config, train_body
from tests.dist import run_ranks


def _two_jobs(cfg_a: dict, cfg_b: dict) -> dict:
    """Ranks 0-1 train model A, ranks 2-3 model B, each on its own half of the world (every collective on its own groups)."""
    import torch.distributed as dist

    from behemoth.config import Config
    from behemoth.topology import init_runtime
    from behemoth.train import Trainer

    mine = Config.model_validate(cfg_a if dist.get_rank() < 2 else cfg_b)
    rt = init_runtime(timeout_s=mine.run.timeout_s, models=2, **mine.parallel.degrees())
    trainer = Trainer(mine, rt)
    summary = trainer.run()
    return {"losses": summary["losses"], "job_rank": rt.rank, "world": rt.world_size, "weights": full_weights(trainer) if rt.is_main else None}


def test_two_models_train_side_by_side_on_disjoint_sub_meshes(tmp_path):
    """A 4-process world split into two 2-process jobs: two different models (another depth, learning rate and seed),
    each on data parallelism over its own half, each equal to its own single-process curve."""
    cfg_a = tiny_config(tmp_path / "a", "parallel.zero_stage=1")
    cfg_b = tiny_config(tmp_path / "b", "model.n_layer=3", "train.lr=1e-3", "train.seed=7")
    got = run_ranks(4, _two_jobs, cfg_a, cfg_b)
    assert [(r["job_rank"], r["world"]) for r in got] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    ref_a = run_ranks(1, train_body, tiny_config(tmp_path / "ref_a"))[0]
    ref_b = run_ranks(1, train_body, tiny_config(tmp_path / "ref_b", "model.n_layer=3", "train.lr=1e-3", "train.seed=7"))[0]
    assert_close_runs(ref_a, got[0])
    assert_close_runs(ref_b, got[2])
    assert got[0]["losses"] != got[2]["losses"]
    assert (tmp_path / "a" / "model.safetensors").exists() and (tmp_path / "b" / "model.safetensors").exists()


def test_problems_names_every_fault_at_once(tmp_path, capsys):
    """A plan with five faults gets five problems, each naming its option, value, constraint and fix, and the command
    prints each on its own line before any worker starts."""
    from behemoth.cli import main
    from behemoth.config import load_config
    from behemoth.planner.feasibility import problems

    faults = [
        "model.n_head=3",
        "model.d_model=48",
        "parallel.pp=2",
        "parallel.tp=2",
        "parallel.zero_stage=3",
        "parallel.recompute=[5]",
        "parallel.microbatches=4",
        "train.global_batch=6",
    ]
    cfg = load_config(None, ["model=gpt-tiny", *faults])
    found = problems(cfg, 4)
    messages = [p.message for p in found]
    expected = {
        "parallel.zero_stage": "parallel.zero_stage=3 with pp=2: ZeRO-3 would gather",
        "parallel.tp": "parallel.tp=2 does not divide model.n_head=3",
        "train.global_batch": "train.global_batch=6 does not split into dp=1 x parallel.microbatches=4",
        "parallel.recompute": "parallel.recompute=[5] names pipeline ranks [5], but there are 2",
    }
    assert {p.option for p in found} >= set(expected), messages
    for option, text in expected.items():
        assert any(p.option == option and text in p.message for p in found), (option, messages)
    assert problems(load_config(None, ["model=gpt-tiny"]), 2) == []
    args = ["train", "--nproc", "4", "model=gpt-tiny", *faults, f"run.dir={tmp_path}/run", f"data.cache_dir={CACHE}"]
    assert main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"behemoth: error: {m}" for m in messages]


def _logits_without_and_with_optimizer(cfg_dict: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The same plan built by `parallelize` alone (no optimizer) and by the training engine: logits of one batch."""
    from behemoth.config import Config
    from behemoth.engine import build_engine, build_model
    from behemoth.topology import init_runtime

    cfg = Config.model_validate(cfg_dict)
    rt = init_runtime(**cfg.parallel.degrees())
    x = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    model = build_model(cfg, rt)
    with torch.no_grad():
        served = model.logits(x)
    engine = build_engine(cfg, rt)
    with torch.no_grad():
        trained = engine.model.logits(x)
    return served, trained, model.state_bytes()


@pytest.mark.parametrize("plan", [["parallel.tp=2", "parallel.sequence_parallel=true"], ["parallel.zero_stage=3"]])
def test_parallelize_without_an_optimizer_gives_the_training_models_logits(tmp_path, plan):
    """What inference will use: the parallel model without an optimizer (no Adam state) computes the logits of the
    model the engine trains, and those of the single-process model (tensor-parallel: this rank's vocabulary shard;
    ZeRO-3: parameters gathered around each block even without gradients)."""
    single = run_ranks(1, _logits_without_and_with_optimizer, tiny_config(tmp_path / "one"))[0][0]
    got = run_ranks(2, _logits_without_and_with_optimizer, tiny_config(tmp_path / "two", *plan))
    for rank, (served, trained, states) in enumerate(got):
        torch.testing.assert_close(served, trained, rtol=0, atol=0)
        assert "optimizer" not in states
        assert "gathered_peak" not in states and "grad_buffers_peak" not in states  # buffer meters count only when asked
        expected = single.chunk(2, dim=-1)[rank] if "parallel.tp=2" in plan else single
        torch.testing.assert_close(served, expected, rtol=1e-5, atol=1e-6)
