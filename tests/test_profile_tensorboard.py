"""Every run writes its metrics as TensorBoard event files beside metrics.jsonl: read back with TensorBoard's own
EventAccumulator, they hold the same numbers at the same steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.common import tiny_config, train_body
from tests.dist import run_ranks


def test_tensorboard_scalars_equal_metrics_jsonl(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from behemoth.metrics import read_metrics, scalars

    run = tmp_path / "run"
    cfg = tiny_config(run, "train.steps=4", "train.eval_every=2", "train.log_every=2", "run.tensorboard=true")
    run_ranks(1, train_body, cfg, timeout=180)
    assert list(run.glob("events.out.tfevents.*")), sorted(p.name for p in run.iterdir())
    board = EventAccumulator(str(run), size_guidance={"scalars": 0})
    board.Reload()
    expected: dict[str, dict[int, float]] = {}
    for record in read_metrics(run / "metrics.jsonl"):
        for name, value in scalars(record).items():
            expected.setdefault(name, {})[record["step"]] = value
    for name in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "memory_mb/rank0", "memory_mb/max", "model_states_mb/rank0"):
        assert name in expected, sorted(expected)
    assert set(board.Tags()["scalars"]) == set(expected)
    for name, by_step in expected.items():
        got = {e.step: e.value for e in board.Scalars(name)}
        assert got.keys() == by_step.keys(), name
        for step, value in by_step.items():
            assert got[step] == pytest.approx(value, rel=1e-6, abs=1e-30), (name, step)
    assert len(expected["loss"]) == 4 and sorted(expected["val_loss"]) == [0, 2, 4]


def test_tensorboard_off_writes_no_events(tmp_path: Path) -> None:
    from behemoth.metrics import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl", tensorboard=False)
    log.write({"step": 1, "loss": 2.0})
    log.close()
    assert not list(tmp_path.glob("events.out.tfevents.*"))
