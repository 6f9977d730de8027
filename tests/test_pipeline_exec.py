"""The pipeline executor equals the single-process run for every schedule, at p=2 and p=4: per-step loss,
validation loss and final weights (float32, 12 steps). Also: tied embeddings, pp x dp, stage-aware
recomputation and its measured memory, pp x dp x tp on 8 processes, ZeRO-1 and ZeRO-2 across pipelines, Hugging Face
models, resume under another layout, a broken executor caught by the
tolerance, a bounded wait that names rank, action and peer, and plans refused before launch."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from behemoth.cli import main
from tests.common import CACHE, assert_close_runs, full_weights, tiny_config, train_body
from tests.dist import run_ranks

DEEP = ["model.n_layer=8", "parallel.microbatches=4"]  # 8 blocks: 2 per stage at p=4 with interleaving


def pipeline_config(run_dir: Path, *overrides: str) -> dict:
    return tiny_config(run_dir, *DEEP, *overrides)


def train_and_report(cfg_dict: dict, resume: str | None = None) -> dict:
    """train_body, plus this rank's pipeline facts: stages held, peak stashed bytes, blocks recomputed."""
    import torch.distributed as dist

    from behemoth.config import Config
    from behemoth.topology import init_runtime
    from behemoth.train import Trainer

    cfg = Config.model_validate(cfg_dict)
    trainer = Trainer(cfg, init_runtime(timeout_s=cfg.run.timeout_s, **cfg.parallel.degrees()), resume=Path(resume) if resume else None)
    summary = trainer.run()
    pipe, module = trainer.engine.model.pipeline, trainer.engine.model.module
    return {
        "losses": summary["losses"],
        "val": summary["val"],
        "start": trainer.start_step,
        "weights": full_weights(trainer) if dist.get_rank() == 0 else None,
        "stages": sorted(pipe.stages),
        "stash": pipe.last_trace.peak_stash_bytes,
        "recomputes": pipe.recomputes,
        "params": sorted(n for n, _ in module.named_parameters()),
        "grads_full": sum(p.grad is not None for p in module.parameters()),
    }


def assert_equivalent(ref: dict, got: list[dict]) -> None:
    assert_close_runs(ref, got[0])
    for (step, a), (_, b) in zip(ref["val"], got[0]["val"]):
        assert abs(a - b) <= 1e-5 * a, f"validation loss at step {step}: {b} vs {a}"
    assert all(r["losses"] == got[0]["losses"] for r in got), "ranks disagree on the loss"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_ranks(1, train_body, pipeline_config(tmp_path_factory.mktemp("ref")))[0]


@pytest.fixture(scope="module")
def tied_reference(tmp_path_factory):
    return run_ranks(1, train_body, pipeline_config(tmp_path_factory.mktemp("tied"), "model.tie_embeddings=true"))[0]


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1", "chimera"])
def test_schedule_matches_single_process(schedule, p, reference, tmp_path):
    got = run_ranks(p, train_and_report, pipeline_config(tmp_path, f"parallel.pp={p}", f"parallel.schedule={schedule}"))
    assert_equivalent(reference, got)
    held = [r["stages"] for r in got]
    if schedule == "chimera":
        assert held == [sorted({r, p - 1 - r}) for r in range(p)]
    elif schedule == "interleaved":
        assert held == [[r, r + p] for r in range(p)]
    else:
        assert held == [[r] for r in range(p)]
    everything = set(reference["weights"])
    assert set().union(*(r["params"] for r in got)) == everything
    if schedule != "chimera" or p > 2:  # Chimera's two ranks at D=2 each hold both stages: the whole model
        assert all(len(r["params"]) < len(everything) for r in got), "a rank holds the whole model"


@pytest.mark.parametrize("p,schedule", [(2, "1f1b"), (4, "interleaved"), (4, "chimera")])
def test_tied_embeddings_stay_tied(p, schedule, tied_reference, tmp_path):
    """First and last stage both hold wte.weight; their gradients are summed, so both copies stay the single-process one."""
    got = run_ranks(p, train_and_report, pipeline_config(tmp_path, "model.tie_embeddings=true", f"parallel.pp={p}", f"parallel.schedule={schedule}"))
    assert_equivalent(tied_reference, got)
    holders = [r for r, res in enumerate(got) if "wte.weight" in res["params"]]
    assert holders == [0, p - 1] and "lm_head.weight" not in got[-1]["params"]


def test_pipeline_times_data_parallel(reference, tmp_path):
    """pp=2 x dp=2 on 4 processes: each pipeline gets half the batch; gradients summed over dp per stage."""
    got = run_ranks(4, train_and_report, pipeline_config(tmp_path, "parallel.pp=2", "parallel.dp=2", "parallel.microbatches=2"))
    assert_equivalent(reference, got)
    assert [r["stages"] for r in got] == [[0], [0], [1], [1]], "the pipeline dimension is outermost in the mesh"


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_three_dimensional_pp_dp_tp_on_eight_processes(zero_stage, tied_reference, tmp_path):
    """pp=2 x dp=2 x tp=2 with ZeRO-1 or ZeRO-2 across dp: tensor parallelism inside each stage, optimizer state (and
    gradients) sharded over the data-parallel pipelines; the tied, vocabulary-split embedding is summed between the
    first and last stage. (Stage 0 across pipelines: test_pipeline_times_data_parallel; ZeRO x tp without a
    pipeline: test_tensor_parallel.)"""
    got = run_ranks(
        8,
        train_and_report,
        pipeline_config(
            tmp_path,
            "model.tie_embeddings=true",
            "parallel.pp=2",
            "parallel.dp=2",
            "parallel.tp=2",
            f"parallel.zero_stage={zero_stage}",
            "parallel.microbatches=2",
        ),
    )
    assert_equivalent(tied_reference, got)
    assert [r["stages"] for r in got] == [[0]] * 4 + [[1]] * 4


@pytest.mark.parametrize("schedule", ["1f1b", "chimera"])
def test_zero_stage_1_across_data_parallel_pipelines(schedule, tied_reference, tmp_path):
    """pp=2 x dp=2 with ZeRO-1 (optimizer state sharded over dp); tied embeddings and Chimera's replica sync
    act on the local gradient sums before ZeRO's reduce-scatter."""
    got = run_ranks(
        4,
        train_and_report,
        pipeline_config(
            tmp_path,
            "model.tie_embeddings=true",
            "parallel.pp=2",
            "parallel.dp=2",
            "parallel.zero_stage=1",
            "parallel.microbatches=2",
            f"parallel.schedule={schedule}",
        ),
    )
    assert_equivalent(tied_reference, got)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved"])
def test_zero_stage_2_across_data_parallel_pipelines(schedule, tied_reference, tmp_path):
    """pp=2 x dp=2 with ZeRO-2: each stage's gradients are reduce-scattered after every backward pass (after the
    weight-gradient pass under ZB-H1, which writes .grad without hooks), no full gradient is kept between
    micro-batches, and the tied embedding, in a bucket of its own, is summed over stages first. Interleaved: two
    stages per rank, each with its own buckets. 4 micro-batches per pipeline, so reductions really accumulate."""
    got = run_ranks(
        4,
        train_and_report,
        pipeline_config(
            tmp_path,
            "model.tie_embeddings=true",
            "parallel.pp=2",
            "parallel.dp=2",
            "parallel.zero_stage=2",
            f"parallel.schedule={schedule}",
            "parallel.bucket_mb=0.05",
        ),
    )
    assert_equivalent(tied_reference, got)
    assert [r["stages"] for r in got] == ([[0, 2]] * 2 + [[1, 3]] * 2 if schedule == "interleaved" else [[0]] * 2 + [[1]] * 2)
    assert all(r["grads_full"] == 0 for r in got), "ZeRO-2 kept a full gradient after the step"


@pytest.mark.parametrize(
    "arch,options,schedule",
    [
        ("llama", ["model=hf:llama", "model.n_head=4", "hf.kv_heads=2", "hf.ffn=64"], "1f1b"),
        ("gpt2", ["model=hf:gpt2", "model.tie_embeddings=true", "model.vocab_size=257"], "zb-h1"),
    ],
)
def test_hugging_face_models_at_p2(arch, options, schedule, tmp_path):
    """Unmodified transformers Llama (grouped-query attention) and GPT-2 (tied head) cut into 2 stages."""
    pytest.importorskip("transformers")
    ref = run_ranks(1, train_body, pipeline_config(tmp_path / "ref", *options))[0]
    got = run_ranks(2, train_and_report, pipeline_config(tmp_path / "pp", *options, "parallel.pp=2", f"parallel.schedule={schedule}"))
    assert_equivalent(ref, got)
    blocks = "model.layers." if arch == "llama" else "transformer.h."
    assert any(n.startswith(blocks + "7.") for n in got[1]["params"]) and not any(n.startswith(blocks + "7.") for n in got[0]["params"])


def test_stage_aware_recomputation_evens_memory(reference, tmp_path):
    """1F1B at p=4: rank r stashes 4-r micro-batches; `early` recomputes on ranks 0 and 1 only, whose stash falls."""
    plain = run_ranks(4, train_and_report, pipeline_config(tmp_path / "plain", "parallel.pp=4"))
    early = run_ranks(4, train_and_report, pipeline_config(tmp_path / "early", "parallel.pp=4", "parallel.recompute=early"))
    assert_equivalent(reference, early)
    assert [r["recomputes"] for r in early] == [True, True, False, False]
    stash, recomputed = [r["stash"] for r in plain], [r["stash"] for r in early]
    assert stash[0] > stash[1] > stash[2], f"1F1B stash should fall with the stage: {stash}"
    assert recomputed[0] < stash[0] / 3 and recomputed[1] < stash[1] / 3, f"{recomputed} vs {stash}"
    assert recomputed[2:] == stash[2:]


def test_hand_written_stage_boundaries(reference, tmp_path):
    got = run_ranks(2, train_and_report, pipeline_config(tmp_path, "parallel.pp=2", "parallel.stage_boundaries=[0,2,8]"))
    assert_equivalent(reference, got)
    assert [p for p in got[0]["params"] if p.startswith("blocks.")][-1].startswith("blocks.1.")


def test_resume_under_another_layout(reference, tmp_path):
    """A pp=2 checkpoint (each rank saved its stages) resumes on one process and continues the curve."""
    first = run_ranks(2, train_and_report, pipeline_config(tmp_path / "run", "parallel.pp=2", "checkpoint.every=6"))
    assert_equivalent(reference, first)
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "run", copy)
    resumed = run_ranks(1, train_body, pipeline_config(copy), str(copy / "checkpoints" / "step_0000006"))[0]
    assert resumed["start"] == 6
    assert_close_runs({"losses": reference["losses"][6:], "weights": reference["weights"]}, resumed)


def test_broken_executor_is_caught(tmp_path):
    """Chimera without its gradient sync between replicas trains a different model: the tolerance catches it."""
    got = run_ranks(2, _train_without_replica_sync, pipeline_config(tmp_path / "broken", "parallel.pp=2", "parallel.schedule=chimera"))[0]
    ref = run_ranks(1, train_body, pipeline_config(tmp_path / "ok"))[0]
    with pytest.raises(AssertionError):
        assert_close_runs(ref, got)


def _train_without_replica_sync(cfg_dict: dict) -> dict:
    from behemoth.parallel.pipeline import executor

    executor._Step.grad_sync = lambda self, index, a: None
    return train_body(cfg_dict)


def test_missing_message_fails_in_bounded_time_naming_rank_action_peer(tmp_path):
    errors = run_ranks(2, _step_with_a_lost_send, pipeline_config(tmp_path, "parallel.pp=2", "run.timeout_s=2"))
    assert "pipeline rank 1 (global rank 1) waited for its message at action" in errors[1]
    assert "RECV_ACT(stage=0, mb=1, from rank 0)" in errors[1] and "with pipeline rank 0 (global rank 0)" in errors[1]
    assert "run.timeout_s=2 s" in errors[1] and "see rank 0's log" in errors[1]


def _step_with_a_lost_send(cfg_dict: dict) -> str:
    """Rank 0 drops its send of micro-batch 1's activation; both ranks run one step and report their error."""
    import dataclasses

    import torch.distributed as dist

    from behemoth.config import Config
    from behemoth.data import BatchLayout, BatchSampler, prepare_corpus
    from behemoth.engine import build_engine
    from behemoth.errors import BehemothError
    from behemoth.parallel.pipeline.schedules import Kind
    from behemoth.topology import init_runtime

    cfg = Config.model_validate(cfg_dict)
    rt = init_runtime(timeout_s=30, **cfg.parallel.degrees())
    engine = build_engine(cfg, rt)
    ex = engine.model.pipeline.executor
    if dist.get_rank() == 0:
        lost = next(j for j, a in enumerate(ex.actions) if a.kind is Kind.SEND_ACT and a.microbatch == 1)
        ex.groups = {
            at: [dataclasses.replace(g, ops=tuple(j for j in g.ops if j != lost)) for g in groups] for at, groups in ex.groups.items()
        }  # out of its group; the SEND action itself issues nothing
    corpus = prepare_corpus(cfg.data.path, cfg.data.val_fraction, cfg.data.cache_dir)
    layout = BatchLayout.resolve(cfg.train.global_batch, 2, 1)
    try:
        engine.train_step(BatchSampler(corpus.train, cfg.seq_len, layout, 0, cfg.train.seed).micro_batches(0), 1e-3)
    except BehemothError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--nproc", "4", "parallel.pp=4"], "parallel.pp=4 makes 4 pipeline stages but model.n_layer=2: every stage needs at least one block"),
        (
            ["--nproc", "2", "parallel.pp=2", "parallel.schedule=interleaved", "model.n_layer=4", "parallel.microbatches=1"],
            "parallel.microbatches=1: interleaved 1F1B needs micro-batches divisible by parallel.pp=2",
        ),
        (
            ["--nproc", "2", "parallel.pp=2", "parallel.schedule=interleaved", "model.n_layer=2", "parallel.microbatches=2"],
            "parallel.pp=2 x parallel.chunks=2 makes 4 pipeline stages but model.n_layer=2",
        ),
        (
            ["--nproc", "3", "parallel.pp=3", "model.n_layer=3", "parallel.schedule=chimera", "parallel.microbatches=4"],
            "parallel.pp=3: Chimera needs an even number of stages",
        ),
        (
            ["--nproc", "2", "parallel.pp=2", "parallel.schedule=chimera", "parallel.microbatches=1"],
            "parallel.microbatches=1: Chimera runs whole basic units of D=2 micro-batches",
        ),
        (["--nproc", "4", "parallel.pp=3"], "pp=3 x ep=1 x tp=1 = 3 does not divide the world size 4"),
        (["--nproc", "4", "parallel.pp=2", "parallel.dp=3"], "= 6, but the world size is 4"),
        (
            ["--nproc", "2", "parallel.pp=2", "parallel.stage_boundaries=[0,2,2]", "model.n_layer=2"],
            "parallel.stage_boundaries=[0, 2, 2] is not strictly increasing",
        ),
        (
            ["--nproc", "2", "parallel.pp=2", "parallel.microbatches=4", "train.micro_batch=1"],
            "train.micro_batch=1 contradicts parallel.microbatches=4",
        ),
        (["--nproc", "4", "parallel.pp=2", "parallel.zero_stage=3"], "parallel.zero_stage=3 with pp=2: ZeRO-3 would gather"),
        (
            ["--nproc", "4", "parallel.pp=2", "parallel.zero_stage=2", "parallel.schedule=chimera", "parallel.microbatches=2"],
            "parallel.zero_stage=2 with parallel.schedule=chimera",
        ),
    ],
)
def test_impossible_pipeline_refused_before_launch(argv, message, capsys, tmp_path):
    tiny = ["model=gpt-tiny", "train.global_batch=8", "train.seq_len=32", "run.progress=false", f"data.cache_dir={CACHE}"]
    assert main(["train", *argv, f"run.dir={tmp_path}/run", *tiny]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("behemoth: error:") and "\n" not in err, err
