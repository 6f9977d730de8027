"""Sub-pipelined tensor parallelism (parallel.tp_subbatches): training equals tp_subbatches=1 and the single process,
each sub-batch's all-reduces are issued separately (and waited on late), and what does not compose is refused before
launch."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from behemoth.config import Config, load_config
from behemoth.planner.feasibility import problems
from tests.common import assert_close_runs, full_weights, tiny_config
from tests.dist import run_ranks


def train_in_turn(cfgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each config trained in turn in this process group: losses, rank 0's weights, and the all-reduces each rank issued
    to the tp group and the seconds it waited on the blocks' sub-batch all-reduces."""
    from behemoth.config import Config
    from behemoth.parallel.tensor.subbatch import SubBatchSchedule
    from behemoth.topology import init_runtime
    from behemoth.train import Trainer

    out = []
    for cfg_dict in cfgs:
        cfg = Config.model_validate(cfg_dict)
        trainer = Trainer(cfg, init_runtime(timeout_s=cfg.run.timeout_s, **cfg.parallel.degrees()))
        summary = trainer.run()
        model = trainer.engine.model
        blocks = model.module.get_submodule(model.lm.layers.blocks).children()
        schedules = [b.forward.__self__ for b in blocks if isinstance(getattr(b.forward, "__self__", None), SubBatchSchedule)]
        weights = full_weights(trainer) if dist.get_rank() == 0 else None
        calls = model.meter.ops["all_reduce"].calls
        waited = sum(sum(s.waited_s.values()) for s in schedules)
        out.append({"losses": summary["losses"], "weights": weights, "all_reduces": calls, "schedules": len(schedules), "waited": waited})
    return out


STEPS = ("train.steps=4", "train.eval_every=0")


def assert_subbatches_match(tmp_path: Any, s: int, reference: dict[str, Any] | None = None) -> None:
    """tp=2 at tp_subbatches 1 and `s`, in one 2-rank launch, equal each other (and the single process, when given; tp=2
    at S=1 equals it in tests/test_tensor_parallel.py)."""
    cfgs = [tiny_config(tmp_path / str(n), *STEPS, "parallel.tp=2", f"parallel.tp_subbatches={n}") for n in (1, s)]
    ranks = run_ranks(2, train_in_turn, cfgs)
    s1, got = ranks[0]
    assert got["losses"] == ranks[1][1]["losses"], "tensor-parallel ranks disagree on the loss"
    assert got["schedules"] == 2 and s1["schedules"] == 0, "every block (2) runs sub-pipelined at S > 1, none at S = 1"
    assert got["waited"] > 0.0
    # a block's 4 all-reduces (2 forward, 2 backward) are issued once per sub-batch: (s - 1) x 4 x 2 blocks more per step
    assert got["all_reduces"] - s1["all_reduces"] == 4 * (s - 1) * 4 * 2
    # the same math per row: losses within 1e-6, weights within 1e-5 (rtol of the tensor's scale, and the absolute floor
    # of the attention key bias, whose gradient is analytically zero: float32 noise that Adam normalizes into steps)
    assert_close_runs(s1, got, loss_rtol=1e-6, weight_rtol=1e-5, weight_atol=1e-5)
    if reference is not None:
        assert_close_runs(reference, got)


def single_process(tmp_path: Any) -> dict[str, Any]:
    return run_ranks(1, train_in_turn, [tiny_config(tmp_path / "ref", *STEPS)])[0][0]


def test_two_subbatches_match_tp(tmp_path):
    assert_subbatches_match(tmp_path, 2)


@pytest.mark.slow
@pytest.mark.parametrize("s", [2, 4])
def test_subbatches_match_tp_and_single_process(tmp_path, s):
    assert_subbatches_match(tmp_path, s, single_process(tmp_path))


def config(*overrides: str) -> Config:
    return Config.model_validate(load_config(None, ["model=gpt-tiny", "train.global_batch=8", *overrides]).model_dump(mode="json"))


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["parallel.sequence_parallel=true"], "sequence parallelism"),
        (["parallel.pp=2", "parallel.tp=1"], "needs parallel.tp >= 2"),
        (["parallel.zero_stage=3"], "ZeRO-3"),
        (["parallel.recompute=full"], "recompute"),
        (["train.micro_batch=2", "parallel.tp_subbatches=4"], "does not split a micro-batch of 2"),
    ],
)
def test_refused_before_launch(overrides, says):
    cfg = config("parallel.tp=2", "parallel.tp_subbatches=2", *overrides)
    found = [p for p in problems(cfg, 2) if p.option == "parallel.tp_subbatches"]
    assert found and says in found[0].message, [str(p) for p in problems(cfg, 2)]


def test_default_and_plain_tp_have_no_problem():
    assert not [p for p in problems(config("parallel.tp=2", "parallel.tp_subbatches=2"), 2) if p.option == "parallel.tp_subbatches"]
    assert not [p for p in problems(config("parallel.tp=2"), 2) if p.option == "parallel.tp_subbatches"]


@pytest.mark.slow
def test_subbatches_with_data_parallel_zero2(tmp_path):
    """dp=2 x tp=2 under ZeRO-2 (4 ranks): S=2 equals S=1 (each parameter's gradient reaches the buckets once)."""
    extra = ("parallel.tp=2", "parallel.zero_stage=2")
    cfgs = [tiny_config(tmp_path / str(n), *STEPS, *extra, f"parallel.tp_subbatches={n}") for n in (1, 2)]
    s1, got = run_ranks(4, train_in_turn, cfgs)[0]
    assert got["schedules"] == 2
    assert_close_runs(s1, got, loss_rtol=1e-6, weight_rtol=1e-5, weight_atol=1e-5)
