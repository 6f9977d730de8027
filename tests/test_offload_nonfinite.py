"""A non-finite step in every step mode (in memory, offload deferred, offload fused into backward): either the weights stay
finite and the step is reported skipped, or the combination is refused before launch in one line."""

from __future__ import annotations

import math

import pytest

from tests.common import tiny_config
from tests.dist import run_ranks

BLOW_UP = ["train.lr=1e4", "train.grad_clip=0", "train.steps=8", "train.eval_every=0"]  # the gradient overflows within a few steps
DISK = ["offload.params=disk", "offload.optimizer=disk"]
MODES = {
    "in memory": [],
    "offload deferred": [*DISK, "offload.step=deferred"],
}


def _problems(*overrides: str) -> list[str]:
    from behemoth.config import Config
    from behemoth.planner.feasibility import problems

    return [p.message for p in problems(Config.model_validate(tiny_config("/tmp/unused", *overrides)), 1)]


@pytest.mark.parametrize("step", ["auto", "fused"])
def test_skipping_a_step_fused_into_backward_is_refused_before_launch_in_one_line(step):
    """offload.step=fused (or auto without clipping) applies each unit's update during backward: nothing can skip it."""
    refused = [m for m in _problems(*BLOW_UP, *DISK, f"offload.step={step}", "train.nonfinite=skip") if "train.nonfinite=skip" in m]
    assert len(refused) == 1 and "\n" not in refused[0] and "offload.step=deferred" in refused[0]


@pytest.mark.parametrize(
    "overrides",
    [[*DISK, "offload.step=deferred", "train.nonfinite=skip"], ["train.nonfinite=skip"], [*DISK, "offload.step=fused", "train.nonfinite=stop"]],
)
def test_steps_that_can_be_skipped_or_stop_are_not_refused(overrides):
    assert not [m for m in _problems(*BLOW_UP, *overrides) if "train.nonfinite" in m]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_skipped_step_leaves_the_weights_finite(mode, tmp_path):
    """train.nonfinite=skip where it is allowed: the step is reported skipped and no weight is NaN or infinite."""
    skipped, finite = run_ranks(1, _blow_up_body, tiny_config(tmp_path, *BLOW_UP, "train.nonfinite=skip", *MODES[mode]))[0]
    assert skipped is not None, "the learning rate must make some step non-finite for the test to test anything"
    assert finite


def test_a_fused_step_stops_with_finite_weights_and_no_checkpoint_of_the_bad_step(tmp_path):
    """train.nonfinite=stop with the step fused into backward: from the first non-finite gradient of a step on no unit
    steps, so the weights stay finite even when the engine is driven on; the run stops before that step's checkpoint."""
    overrides = (*BLOW_UP, "train.nonfinite=stop", *DISK, "offload.step=fused")
    skipped, finite = run_ranks(1, _blow_up_body, tiny_config(tmp_path / "engine", *overrides))[0]
    assert skipped is not None and finite
    stopped, saved = run_ranks(1, _stopping_body, tiny_config(tmp_path / "run", *overrides, "checkpoint.every=1", "checkpoint.keep=10"))[0]
    assert stopped == skipped + 1 and saved == list(range(1, stopped)), (stopped, saved)


def _blow_up_body(cfg_dict: dict) -> tuple[int | None, bool]:
    """Every step, whatever happens (as train.nonfinite=skip does); (the first skipped step or None, whether every weight
    this rank holds is finite at the end)."""
    import torch

    from behemoth.config import Config
    from behemoth.engine import lr_at
    from behemoth.topology import init_runtime
    from behemoth.train import Trainer

    cfg = Config.model_validate(cfg_dict)
    rt = init_runtime(timeout_s=cfg.run.timeout_s)
    trainer = Trainer(cfg, rt)
    engine, skipped = trainer.engine, None
    try:
        for step in range(cfg.train.steps):
            result = engine.train_step(trainer.train_data.micro_batches(step), lr_at(step, cfg.train))
            if result.skipped:
                assert not math.isfinite(result.grad_norm)
                skipped = step if skipped is None else skipped
        pieces = [t for _, t in _held(engine.state_dict()["model"].values())]
        return skipped, all(bool(torch.isfinite(t).all()) for t in pieces)
    finally:
        engine.close()
        rt.close()


def _held(values):
    """This rank's tensors of a model state: whole tensors, or the chunks a sharded one holds."""
    for t in values:
        yield from getattr(t, "_chunks", [((), t)])


def _stopping_body(cfg_dict: dict) -> tuple[int, list[int]]:
    """Trains until train.nonfinite=stop ends the run; (the step it names, the steps checkpointed)."""
    import re
    from pathlib import Path

    from behemoth.config import Config
    from behemoth.errors import BehemothError
    from behemoth.topology import init_runtime
    from behemoth.train import Trainer

    cfg = Config.model_validate(cfg_dict)
    rt = init_runtime(timeout_s=cfg.run.timeout_s)
    try:
        with pytest.raises(BehemothError, match="training stopped") as err:
            Trainer(cfg, rt).run()
        saved = sorted(int(p.name.removeprefix("step_")) for p in (Path(cfg.run.dir) / "checkpoints").glob("step_*"))
        return int(re.match(r"step (\d+):", str(err.value)).group(1)), saved
    finally:
        rt.close()
