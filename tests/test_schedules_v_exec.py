"""The V-shaped zero-bubble schedules (zbv, dualpipev) and Merak's shifted critical path (1f1b-scp), executed: per-step
loss, validation loss and final weights equal the single-process run (float32, 12 steps) at p=2, and at p=4 under the
slow marker; the V places stages r and 2p-1-r on rank r; SCP recomputes exactly the micro-batches its schedule says and
holds fewer activations than 1F1B; a broken recomputation is caught by the same tolerance."""

from __future__ import annotations

import pytest

from tests.common import train_body
from tests.dist import run_ranks
from tests.test_pipeline_exec import assert_equivalent, pipeline_config, train_and_report

V_SCHEDULES = ["zbv", "dualpipev"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_ranks(1, train_body, pipeline_config(tmp_path_factory.mktemp("ref")))[0]


def run_schedule(tmp_path, p: int, schedule: str, *overrides: str) -> list[dict]:
    return run_ranks(p, train_and_report, pipeline_config(tmp_path, f"parallel.pp={p}", f"parallel.schedule={schedule}", *overrides))


def assert_v_equivalent(got: list[dict], reference: dict, p: int) -> None:
    assert_equivalent(reference, got)
    assert [r["stages"] for r in got] == [[r, 2 * p - 1 - r] for r in range(p)], "rank r holds stage r and stage 2p-1-r"
    assert set().union(*(r["params"] for r in got)) == set(reference["weights"])


@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_v_schedule_matches_single_process_at_p2(schedule, reference, tmp_path):
    assert_v_equivalent(run_schedule(tmp_path, 2, schedule), reference, 2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", V_SCHEDULES)
def test_v_schedule_matches_single_process_at_p4(schedule, tmp_path_factory, tmp_path):
    """p=4: eight stages of one block each; DualPipeV needs 2p = 8 micro-batches (and its reference the same split)."""
    extra = ["parallel.microbatches=8"] if schedule == "dualpipev" else []
    ref = run_ranks(1, train_body, pipeline_config(tmp_path_factory.mktemp("ref8"), *extra))[0] if extra else None
    got = run_schedule(tmp_path, 4, schedule, *extra)
    assert_v_equivalent(got, ref or run_ranks(1, train_body, pipeline_config(tmp_path_factory.mktemp("ref4")))[0], 4)


def scp_report(cfg_dict: dict) -> dict:
    """Train; this rank's losses, rank 0's weights, whether blocks are checkpointed, the last step's recomputations."""
    import torch.distributed as dist

    from behemoth.config import Config
    from behemoth.parallel.pipeline.schedules import Kind
    from behemoth.topology import init_runtime
    from behemoth.train import Trainer
    from tests.common import full_weights

    cfg = Config.model_validate(cfg_dict)
    trainer = Trainer(cfg, init_runtime(timeout_s=cfg.run.timeout_s, **cfg.parallel.degrees()))
    summary = trainer.run()
    pipe = trainer.engine.model.pipeline
    return {
        "losses": summary["losses"],
        "val": summary["val"],
        "weights": full_weights(trainer) if dist.get_rank() == 0 else None,
        "recomputes": pipe.recomputes,
        "recomputed": sorted(t.action.microbatch for t in pipe.last_trace.times if t.action.kind is Kind.RECOMPUTE),
    }


def test_shifted_critical_path_matches_single_process(reference, tmp_path):
    """1f1b-scp at p=2: equal to one process; no block checkpointed (the schedule recomputes): rank 0 recomputes all
    but its last micro-batch, the last stage nothing."""
    got = run_ranks(2, scp_report, pipeline_config(tmp_path, "parallel.pp=2", "parallel.schedule=1f1b-scp"))
    assert_equivalent(reference, got)
    assert [r["recomputes"] for r in got] == [False, False]
    assert [r["recomputed"] for r in got] == [[0, 1, 2], []]


@pytest.mark.slow
def test_shifted_critical_path_at_p4_matches_and_holds_less_than_1f1b(reference, tmp_path):
    """p=4: equal to one process, and rank 0 holds 2 micro-batches' activations at its peak where 1F1B holds 4."""
    got = run_schedule(tmp_path / "scp", 4, "1f1b-scp")
    assert_equivalent(reference, got)
    plain = run_schedule(tmp_path / "1f1b", 4, "1f1b")
    assert got[0]["stash"] < 0.75 * plain[0]["stash"], (got[0]["stash"], plain[0]["stash"])
    assert got[-1]["stash"] == plain[-1]["stash"], "the last stage does not recompute"


def test_scp_refuses_a_recompute_policy_it_would_override():
    from behemoth.errors import BehemothError
    from behemoth.parallel.pipeline.apply import check_scp_recompute

    check_scp_recompute("none")
    check_scp_recompute("full")
    with pytest.raises(BehemothError, match=r"^parallel.recompute='early' with parallel.schedule=1f1b-scp: the schedule itself picks"):
        check_scp_recompute("early")
