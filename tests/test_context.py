"""Context parallelism (parallel.cp=2) trains the single-process curve: losses, gradient norms and final weights of
behemoth's GPT, a Hugging Face Llama (grouped-query attention) and an MoE GPT under ring and Ulysses attention, with
ZeRO-3 over the cp ranks, under pipelines (pp=2 x cp=2) and with expert parallelism (ep=2 x cp=2); a wrong RoPE offset
(each shard's local positions instead of its global ones) and load-balancing counts taken over a shard are caught by
the same comparison; what cp does not compose with is refused before launch. The attention functions themselves are tested
against SDPA in tests/test_context_attention.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from behemoth.errors import BehemothError
from tests.common import assert_close_runs, tiny_config
from tests.dist import run_ranks

BASE = ["train.steps=3", "train.eval_every=0", "train.log_every=3", "checkpoint.async_save=false"]
LLAMA = ["model=hf:llama", "model.n_head=4", "hf.kv_heads=2", "hf.ffn=64"]
MOE = ["model=gpt-moe-tiny", "model.moe.aux_coef=0.1"]  # 4 experts, top-2, dropless; a load-balancing loss that moves the weights
MODELS = {"gpt": [], "llama": LLAMA, "moe": MOE}
OFFLOAD = {tier: [f"offload.params={tier}", f"offload.optimizer={tier}"] for tier in ("host", "disk")}
RUNS = {  # name: (model, cp options)
    "gpt-ring": ("gpt", ["parallel.cp=2", "parallel.cp_mode=ring"]),
    "gpt-ulysses": ("gpt", ["parallel.cp=2", "parallel.cp_mode=ulysses"]),
    "llama-ring": ("llama", ["parallel.cp=2", "parallel.cp_mode=ring"]),
    "llama-ulysses": ("llama", ["parallel.cp=2", "parallel.cp_mode=ulysses"]),
    "gpt-ring-zero3": ("gpt", ["parallel.cp=2", "parallel.cp_mode=ring", "parallel.zero_stage=3"]),
    "moe-ring": ("moe", ["parallel.cp=2", "parallel.cp_mode=ring"]),
    "gpt-ring-offload-host": ("gpt", ["parallel.cp=2", "parallel.cp_mode=ring", *OFFLOAD["host"]]),  # streamed shards
    "gpt-ulysses-offload-disk": ("gpt", ["parallel.cp=2", "parallel.cp_mode=ulysses", *OFFLOAD["disk"]]),
    "llama-ring-offload-host": ("llama", ["parallel.cp=2", "parallel.cp_mode=ring", *OFFLOAD["host"]]),
    "llama-ring-local-positions": ("llama", ["parallel.cp=2", "parallel.cp_mode=ring"]),  # the deliberate bugs
    "moe-ring-local-aux": ("moe", ["parallel.cp=2", "parallel.cp_mode=ring"]),
    "llama-ring-offload-host-local-positions": ("llama", ["parallel.cp=2", "parallel.cp_mode=ring", *OFFLOAD["host"]]),
}
BUGS = ("local-positions", "local-aux")


def bug_of(name: str) -> str | None:
    return next((b for b in BUGS if name.endswith(b)), None)


def config(model: str, run_dir: Path, *options: str) -> dict[str, Any]:
    return tiny_config(run_dir, *BASE, *MODELS[model], *options)


def train_runs(cfgs: list[tuple[dict[str, Any], str | None]]) -> list[dict[str, Any]]:
    """Train each config in this set of processes: per step the loss and gradient norm; rank 0 the exported weights.
    A deliberate bug by name: `local-positions`, every shard embedded at positions 0 .. T/cp - 1; `local-aux`, an MoE
    layer's load-balancing counts taken over its shard of each sequence instead of the whole sequence."""
    from behemoth.parallel.context import apply
    from behemoth.parallel.context.layout import ContextLayout

    out, positions, summed = [], ContextLayout.positions, apply.summed_over
    for cfg_dict, bug in cfgs:
        if bug == "local-positions":
            ContextLayout.positions = lambda self, seq_len, device=None: positions(ContextLayout(1, 0, False), seq_len // self.cp, device)
        if bug == "local-aux":
            apply.summed_over = lambda t, group, meter: t
        try:
            out.append(train_one_config(cfg_dict))
        finally:
            ContextLayout.positions, apply.summed_over = positions, summed
    return out


def train_one_config(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    from behemoth.config import Config
    from behemoth.faults import checkpoint as ckpt_io
    from behemoth.models.causal_lm import build_causal_lm
    from behemoth.topology import init_runtime
    from behemoth.train import Trainer
    from tests.common import full_weights

    cfg = Config.model_validate(cfg_dict)
    trainer = Trainer(cfg, init_runtime(timeout_s=cfg.run.timeout_s, **cfg.parallel.degrees()))
    try:
        records = [trainer.train_one(step, 1.0) for step in range(cfg.train.steps)]
        trainer.save(cfg.train.steps)
        trainer.saver.wait()
        weights = None
        if dist.get_rank() == 0:
            module = build_causal_lm(cfg.model, cfg.hf).module
            ckpt_io.export_safetensors(ckpt_io.resolve_checkpoint(trainer.run_dir), trainer.run_dir / "model.safetensors", module)
            weights = full_weights(trainer)
        dist.barrier()
    finally:
        trainer.engine.close()
    return {"losses": [r["loss"] for r in records], "grad_norms": [r["grad_norm"] for r in records], "weights": weights}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """The single-process run of each model, and every cp=2 run on one pair of processes."""
    tmp = tmp_path_factory.mktemp("context")
    refs = run_ranks(1, train_runs, [(config(m, tmp / f"ref-{m}"), None) for m in MODELS], timeout=240)[0]
    cfgs = [(config(model, tmp / name, *options), bug_of(name)) for name, (model, options) in RUNS.items()]
    ranks = run_ranks(2, train_runs, cfgs, timeout=60 + 40 * len(cfgs))
    for i, name in enumerate(RUNS):
        assert ranks[0][i]["losses"] == ranks[1][i]["losses"], f"{name}: the cp ranks disagree on the loss"
    return {**{f"ref-{m}": r for m, r in zip(MODELS, refs)}, **dict(zip(RUNS, ranks[0]))}


def assert_same_run(ref: dict[str, Any], got: dict[str, Any]) -> None:
    """Losses within 1e-5, weights within 1e-4 (tests/common.py), and each step's global gradient norm within 1e-4."""
    assert_close_runs(ref, got)
    for step, (a, b) in enumerate(zip(ref["grad_norms"], got["grad_norms"]), 1):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {step}: gradient norm {b!r} vs reference {a!r}"


@pytest.mark.parametrize("name", [n for n in RUNS if bug_of(n) is None])
def test_context_parallel_trains_the_single_process_curve(runs, name: str) -> None:
    assert_same_run(runs[f"ref-{RUNS[name][0]}"], runs[name])


@pytest.mark.parametrize("name", ["llama-ring-local-positions", "llama-ring-offload-host-local-positions"])
def test_a_wrong_rope_offset_is_caught(runs, name: str) -> None:
    """Each shard rotated as if it began the sequence (in memory, and by offload's streamer in its forward and its
    recomputation): the comparison that passes above fails."""
    with pytest.raises(AssertionError):
        assert_same_run(runs["ref-llama"], runs[name])


def test_load_balancing_counted_over_a_shard_is_caught(runs) -> None:
    """An MoE layer's expert fractions counted over each rank's half of the sequence: the comparison above fails."""
    with pytest.raises(AssertionError):
        assert_same_run(runs["ref-moe"], runs["moe-ring-local-aux"])


def refusal(*options: str, world: int = 2) -> list[str]:
    from behemoth.config import load_config
    from behemoth.planner.feasibility import problems

    cfg = load_config(None, ["model=gpt-tiny", "train.seq_len=32", "train.global_batch=8", "run.dir=/tmp/behemoth-never-written", *options])
    return [p.message for p in problems(cfg, world)]


@pytest.mark.parametrize(
    "options,world,words",
    [
        (["parallel.cp=2", "model=gpt-moe-tiny", "model.moe.capacity_factor=1.25"], 2, "capacity is filled in token order"),
        (["parallel.cp=2", "model=gpt-moe-tiny", "model.moe.noise=gumbel"], 2, "would draw other noise"),
        (["parallel.cp=4", "parallel.cp_mode=ulysses"], 4, "does not divide model.n_head=2"),
        (["parallel.cp=2", "parallel.cp_mode=ring", "train.seq_len=30"], 2, "does not cut into ring attention's 2 x parallel.cp=2 = 4"),
        (["parallel.cp=2", "model.dropout=0.1"], 2, "the sharded attention has no dropout"),
        (["parallel.cp=3"], 2, "cp=3"),
    ],
)
def test_what_cp_cannot_run_is_refused_before_launch(options: list[str], world: int, words: str) -> None:
    found = refusal(*options, world=world)
    assert any(words in m and "\n" not in m for m in found), found


def test_a_sliding_window_model_is_refused(tmp_path) -> None:
    import transformers

    from tests.test_hf_families import SHAPE

    transformers.AutoConfig.for_model("mistral", **SHAPE, sliding_window=8).save_pretrained(str(tmp_path / "mistral"))  # config.json only
    found = refusal("parallel.cp=2", f"hf.weights={tmp_path / 'mistral'}")
    assert any("sliding attention window of 8" in m for m in found), found


def test_plain_layouts_pass() -> None:
    assert refusal("parallel.cp=2") == [] and refusal("parallel.cp=2", "parallel.zero_stage=3") == []
    assert refusal("parallel.cp=2", *OFFLOAD["host"]) == [] and refusal("parallel.cp=2", *OFFLOAD["disk"]) == []
    assert refusal("parallel.cp=2", "parallel.pp=2", *OFFLOAD["disk"], world=4) == []
    assert refusal("parallel.cp=2", "parallel.pp=2", world=4) == []
    with pytest.raises(BehemothError, match="cp=2"):
        from behemoth.topology import resolve_dims

        resolve_dims(3, cp=2)


CLI = ["model=gpt-tiny", "train.global_batch=8", "train.seq_len=32", "train.eval_every=3", "train.eval_batches=1", "train.peak_tflops=1"]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], [*OFFLOAD["disk"], "checkpoint.export=true"]], ids=["in-memory", "offload-disk"])
def test_cli_trains_checkpoints_and_resumes_under_cp(tmp_path, extra: list[str]) -> None:
    """`behemoth train --nproc 2 parallel.cp=2` (and with the states offloaded to disk): 6 steps, checkpoints every 3;
    a copy resumed from step 3 continues the same curve (losses within 1e-5), and the run exports."""
    import shutil

    from behemoth.metrics import read_metrics
    from tests.test_cli import behemoth

    run = tmp_path / "run"
    proc = behemoth("train", "--nproc", "2", "parallel.cp=2", "train.steps=6", "checkpoint.every=3", f"run.dir={run}", *CLI, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "x cp=2 (ulysses)" in proc.stdout and (run / "model.safetensors").exists()
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step_0000006")
    (copy / "checkpoints" / "latest").write_text("step_0000003\n")
    proc = behemoth("train", "--nproc", "2", "--resume", str(copy))
    assert proc.returncode == 0, proc.stderr[-3000:]
    full, resumed = ({r["step"]: r["loss"] for r in read_metrics(d / "metrics.jsonl") if "loss" in r} for d in (run, copy))
    assert sorted(resumed) == list(range(1, 7))
    for step in (4, 5, 6):
        assert abs(full[step] - resumed[step]) <= 1e-5 * full[step], (step, full[step], resumed[step])


@pytest.mark.slow
@pytest.mark.parametrize("model,mode", [("gpt", "ring"), ("llama", "ulysses")])
def test_cp4_trains_the_single_process_curve(tmp_path, model: str, mode: str) -> None:
    """cp=4 on 4 processes (4 K/V blocks around the ring; Ulysses with 4 heads, 2 K/V heads repeated)."""
    ref = run_ranks(1, train_runs, [(config(model, tmp_path / "ref"), None)], timeout=240)[0][0]
    got = run_ranks(4, train_runs, [(config(model, tmp_path / "cp4", "parallel.cp=4", f"parallel.cp_mode={mode}"), None)], timeout=600)[0][0]
    assert_same_run(ref, got)


FOUR = {  # name: (model, options) on 4 processes: pp=2 x cp=2, and ep=2 x cp=2
    "llama-ulysses-1f1b": ("llama", ["parallel.cp=2", "parallel.cp_mode=ulysses", "parallel.pp=2", "parallel.microbatches=2"]),
    "gpt-ring-zb-h1": ("gpt", ["parallel.cp=2", "parallel.cp_mode=ring", "parallel.pp=2", "parallel.schedule=zb-h1", "parallel.microbatches=2"]),
    "moe-ring-ep2": ("moe", ["parallel.cp=2", "parallel.cp_mode=ring", "parallel.ep=2"]),
    "llama-ring-1f1b-local-positions": ("llama", ["parallel.cp=2", "parallel.cp_mode=ring", "parallel.pp=2", "parallel.microbatches=2"]),
}


@pytest.fixture(scope="module")
def four(runs, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Runs on one set of 4 processes. pp=2 x cp=2: each stage receives its cp shard of the previous stage's activations
    and embeds / rotates its tokens at their global positions (parallel/context/apply.py ContextPipelineSteps).
    ep=2 x cp=2: expert gradients summed over dp x cp, the ranks holding the same experts (Runtime.expert_data_group)."""
    tmp = tmp_path_factory.mktemp("context-pp")
    cfgs = [(config(model, tmp / name, *options), bug_of(name)) for name, (model, options) in FOUR.items()]
    ranks = run_ranks(4, train_runs, cfgs, timeout=60 + 60 * len(cfgs))
    return dict(zip(FOUR, ranks[0]))


@pytest.mark.parametrize("name", [n for n in FOUR if bug_of(n) is None])
def test_context_parallel_with_a_pipeline_or_experts_trains_the_single_process_curve(runs, four, name: str) -> None:
    assert_same_run(runs[f"ref-{FOUR[name][0]}"], four[name])


def test_a_pipeline_stage_at_local_positions_is_caught(runs, four) -> None:
    """Every stage's shard rotated as if it began the sequence: the comparison above fails."""
    with pytest.raises(AssertionError):
        assert_same_run(runs["ref-llama"], four["llama-ring-1f1b-local-positions"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "model,mode,tier,bug", [("llama", "ulysses", "host", None), ("gpt", "ring", "disk", None), ("llama", "ring", "host", "local-positions")]
)
def test_cp_with_offload_under_a_pipeline_trains_the_single_process_curve(runs, tmp_path, model: str, mode: str, tier: str, bug: str | None) -> None:
    """pp=2 x cp=2 x offload on 4 processes: each stage streams its units over its dp x cp ranks, and every stage's
    embedding, rotary context and recomputation run at its shard's global positions (offload/stage_stream.py); with
    every shard at local positions the same comparison fails."""
    options = ["parallel.cp=2", f"parallel.cp_mode={mode}", "parallel.pp=2", "parallel.microbatches=2", *OFFLOAD[tier]]
    got = run_ranks(4, train_runs, [(config(model, tmp_path / "pp-cp-offload", *options), bug)], timeout=600)[0][0]
    if bug is None:
        assert_same_run(runs[f"ref-{model}"], got)
    else:
        with pytest.raises(AssertionError):
            assert_same_run(runs[f"ref-{model}"], got)
