"""Tensor (and sequence) parallel training equals the single-process run: per-step loss and final weights.

The weights compared are the ones `behemoth export` consolidates from the TP checkpoint, so every
test also checks that a split checkpoint reads back under single-process names and full shapes.
"""

from __future__ import annotations

import shutil

import pytest

from behemoth.config import load_config
from tests.common import assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """12 single-process steps, checkpointing every 6 (the resume tests start from step 6)."""
    run_dir = tmp_path_factory.mktemp("ref")
    return run_ranks(1, train_body, tiny_config(run_dir, "checkpoint.every=6"))[0]


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tp2")
    return run_dir, run_ranks(2, train_body, tiny_config(run_dir, "parallel.tp=2", "checkpoint.every=6"))


def test_tp2_matches_single_process(reference, tp2_run):
    _, got = tp2_run
    assert_close_runs(reference, got[0])
    assert got[0]["losses"] == got[1]["losses"], "tensor-parallel ranks disagree on the loss"


def test_tp2_sequence_parallel_matches_single_process(reference, tmp_path):
    got = run_ranks(2, train_body, tiny_config(tmp_path, "parallel.tp=2", "parallel.sequence_parallel=true"))
    assert_close_runs(reference, got[0])


def test_vocabulary_not_divisible_by_tp(tmp_path):
    """Vocabulary 257 at t=2: rows padded to 2 x 129 and masked; tied head and SP on the same split."""
    extra = ["model.vocab_size=257", "model.tie_embeddings=true"]
    ref = run_ranks(1, train_body, tiny_config(tmp_path / "ref", *extra))[0]
    got = run_ranks(2, train_body, tiny_config(tmp_path / "tp", *extra, "parallel.tp=2", "parallel.sequence_parallel=true"))[0]
    assert ref["weights"]["wte.weight"].shape == (257, 32)
    assert_close_runs(ref, got)


@pytest.mark.parametrize(
    "world,extra", [(1, []), (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]), (4, ["parallel.tp=2", "parallel.zero_stage=2"])]
)
def test_tp_checkpoint_resumes_on_another_layout(reference, tp2_run, tmp_path, world, extra):
    """A tp=2 checkpoint of step 6 continues the single-process curve on 1 process, on tp=2 with SP, and on
    dp=2 x tp=2 with ZeRO-2 (loaded into flat shards of the tp pieces)."""
    run_dir, _ = tp2_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    resumed = run_ranks(world, train_body, tiny_config(copy, "checkpoint.every=6", *extra), str(copy / "checkpoints/step_0000006"))[0]
    assert resumed["start"] == 6
    assert_close_runs({"losses": reference["losses"][6:], "weights": reference["weights"]}, resumed)


@pytest.mark.parametrize("broken,sp", [("copy_to_tp", "false"), ("sequence_grad_sum", "true")])
def test_missing_all_reduce_would_be_caught(reference, tmp_path, broken, sp):
    """The tolerance is tight enough: dropping f's backward all-reduce, or the tp sum of the gradients
    of the norm weights and row-parallel biases that SP runs on sequence chunks, moves the run far beyond it."""
    cfg = tiny_config(tmp_path, "parallel.tp=2", f"parallel.sequence_parallel={sp}")
    got = run_ranks(2, _train_broken, cfg, broken)[0]
    with pytest.raises(AssertionError):
        assert_close_runs(reference, got)


def _train_broken(cfg_dict, broken):
    from behemoth.parallel.tensor import comm, plan

    if broken == "copy_to_tp":
        comm._CopyToTP.backward = staticmethod(lambda ctx, grad: (grad, None))
    else:
        plan.TensorParallel.finish_grads = lambda self, slices: None
    return train_body(cfg_dict)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["parallel.tp=4", "model.n_head=2"], "parallel.tp=4 does not divide model.n_head=2"),
        (["model=hf:llama", "hf.ffn=63", "parallel.tp=2"], "parallel.tp=2 does not divide the MLP width=63"),
        (["model=hf:llama", "model.n_head=4", "hf.kv_heads=1", "parallel.tp=2"], "parallel.tp=2 does not divide hf.kv_heads=1"),
        (["parallel.tp=2", "parallel.sequence_parallel=true", "train.seq_len=31"], "does not divide sequence length (train.seq_len)=31"),
    ],
)
def test_unsplittable_model_is_refused(tmp_path, overrides, message):
    from behemoth.planner.feasibility import problems

    cfg = load_config(None, ["model=gpt-tiny", *overrides])
    found = [p.message for p in problems(cfg, cfg.parallel.tp)]
    assert len(found) == 1 and message in found[0], found


def test_tp_times_dp_must_equal_world(capsys, tmp_path):
    from behemoth.cli import main

    assert main(["train", "--nproc", "2", "parallel.tp=4", "model=gpt-tiny", "model.n_head=4", f"run.dir={tmp_path}/run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tp=4 = 4 does not divide the world size 2" in err[0]


@pytest.mark.parametrize("stage,sp", [(1, "true"), (2, "false"), (3, "true")])
def test_dp2_tp2_zero_matches_single_process(reference, tmp_path, stage, sp):
    """The 2-D mesh: tp=2 innermost, ZeRO over dp=2 flat-shards each tp rank's local tensors (4 processes).
    Optimizer state (stage 1), gradients (2) and parameters (3) fall to about a quarter; the rest to a half.
    The weights compared are consolidated from the checkpoint, whose chunks are ZeRO ranges of tp pieces."""
    cfg = tiny_config(tmp_path, "parallel.tp=2", f"parallel.zero_stage={stage}", f"parallel.sequence_parallel={sp}")
    got = run_ranks(4, _train_reporting_states, cfg)
    assert_close_runs(reference, got[0])
    assert all(r["losses"] == got[0]["losses"] for r in got), "ranks disagree on the loss"
    full = sum(t.numel() * 4 for t in reference["weights"].values())  # float32 parameters of the single-process model
    # a quarter or a half (+ the norms and wpe tp replicates, + ZeRO padding) of parameters, gradients and 2 Adam moments
    share = {part: 0.27 if stage >= sharded_from else 0.52 for part, sharded_from in (("params", 3), ("grads", 2), ("optimizer", 1))}
    for rank in got:
        states = rank["states"]
        assert all(states[part] < share[part] * full * (2 if part == "optimizer" else 1) for part in share), (stage, states)
        assert stage == 3 or states["params"] > 0.4 * full, "stages 1-2 keep the whole tp-local parameters"


PP_SP = ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.microbatches=2"]


def test_pp2_tp2_sequence_parallel_matches_single_process(reference, tmp_path):
    """pp=2 x tp=2 with SP (4 processes, 1F1B): the stages exchange [B, T/2, d] activations and gradients (each tp
    rank its own sequence chunk); stage 1 holds no block 0 and its ln_f gathers the sequence for the head."""
    got = run_ranks(4, train_body, tiny_config(tmp_path, *PP_SP))
    assert_close_runs(reference, got[0])
    assert all(r["losses"] == got[0]["losses"] for r in got), "ranks disagree on the loss"


@pytest.mark.parametrize(
    "options,schedule",
    [
        (["model.tie_embeddings=true", "model.vocab_size=257"], "zb-h1"),
        (["model=hf:llama", "model.n_head=4", "hf.kv_heads=2", "hf.ffn=64"], "1f1b"),
    ],
)
def test_pp2_tp2_sequence_parallel_variants(tmp_path, options, schedule):
    """Zero-bubble split backward (weight gradients from the re-gathered shard in the weight pass) with a tied,
    padded vocabulary on both end stages; Hugging Face Llama, whose stage 1 builds rotary embeddings and the causal
    mask for the whole sequence from its sequence chunk."""
    if any(o.startswith("model=hf:") for o in options):
        pytest.importorskip("transformers")
    ref = run_ranks(1, train_body, tiny_config(tmp_path / "ref", *options))[0]
    got = run_ranks(4, train_body, tiny_config(tmp_path / "pp", *options, *PP_SP, f"parallel.schedule={schedule}"))
    assert_close_runs(ref, got[0])


def _train_reporting_states(cfg_dict):
    from behemoth import train

    built = []
    real_engine = train.build_engine

    def build_measuring(*args, **kwargs):
        built.append(real_engine(*args, **kwargs))
        built[-1].model.measure_buffers()
        return built[-1]

    train.build_engine = build_measuring
    result = train_body(cfg_dict)
    return {**result, "states": built[0].model_state_bytes()}
