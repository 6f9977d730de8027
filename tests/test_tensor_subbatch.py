"""Sub-pipelined tensor parallelism (parallel.tp_subbatches): training equals tp_subbatches=1 and the single process,
each sub-batch's all-reduces are issued separately (and waited on late), and what does not compose is refused before
launch."""

from __future__ import annotations

import pytest

from behemoth.config import Config, load_config
from behemoth.planner.feasibility import problems
from tests.common import assert_close_runs, tiny_config, train_body
from tests.dist import run_ranks


RUNS = {"ref": (1, []), "s1": (2, ["parallel.tp=2"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Lazily: the single process and tp=2 (6 steps of micro-batch 8), once per module."""
    out: dict = {}

    def get(name: str, world: int = 2, *extra: str):
        if name not in out:
            world, extra = RUNS.get(name, (world, extra))
            cfg = tiny_config(tmp_path_factory.mktemp(name), "train.steps=6", "train.eval_every=0", *extra)
            out[name] = run_ranks(world, train_body, cfg)
        return out[name]

    return get


def check_subbatches(runs, s: int) -> None:
    got = runs(f"s{s}", 2, "parallel.tp=2", f"parallel.tp_subbatches={s}")
    assert got[0]["losses"] == got[1]["losses"], "tensor-parallel ranks disagree on the loss"
    # the same math per row: losses within 1e-6, weights within 1e-5 (rtol of the tensor's scale, and the absolute floor
    # of the attention key bias, whose gradient is analytically zero: float32 noise that Adam normalizes into steps)
    assert_close_runs(runs("s1")[0], got[0], loss_rtol=1e-6, weight_rtol=1e-5, weight_atol=1e-5)
    assert_close_runs(runs("ref")[0], got[0])


def test_two_subbatches_match_tp_and_single_process(runs):
    check_subbatches(runs, 2)


@pytest.mark.slow
def test_four_subbatches_match_tp_and_single_process(runs):
    check_subbatches(runs, 4)


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
