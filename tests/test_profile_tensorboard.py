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


def _train_with_counters(cfg_dict: dict, root: str) -> dict:
    """Train with the host's energy counters read from a powercap tree under `root` that gains 9 kJ per reading."""
    import behemoth.train
    from behemoth.config import Config
    from behemoth.profiler.energy import read_counters
    from behemoth.topology import init_runtime

    calls = []

    def counters():  # noqa: ANN202
        calls.append(1)
        zone = Path(root) / "intel-rapl:0"
        zone.mkdir(parents=True, exist_ok=True)
        (zone / "energy_uj").write_text(f"{9_000_000_000 * len(calls)}\n")
        (zone / "max_energy_range_uj").write_text(f"{10**12}\n")
        return read_counters(Path(root))

    behemoth.train.read_counters = counters
    cfg = Config.model_validate(cfg_dict)
    return behemoth.train.Trainer(cfg, init_runtime(timeout_s=60)).run()


def test_a_runs_energy_reaches_its_summary_metrics_and_tensorboard(tmp_path: Path) -> None:
    """Where counters are readable, the run's joules, kWh and cost (run.kwh_price) are in its summary, in metrics.jsonl
    and in TensorBoard; where they are not, the closing line says why."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from behemoth.metrics import read_metrics
    from behemoth.profiler.energy import Reading, run_energy, run_energy_line

    run = tmp_path / "run"
    cfg = tiny_config(run, "train.steps=2", "run.tensorboard=true", "run.kwh_price=0.5")
    summary = run_ranks(1, _train_with_counters, cfg, str(tmp_path / "powercap"), timeout=180)[0]
    energy = summary["energy"]
    assert energy["joules"] == pytest.approx(9000.0) and energy["kwh"] == pytest.approx(0.0025) and energy["cost"] == pytest.approx(0.00125)
    assert run_energy_line(energy).startswith("energy 0.0025 kWh (9 kJ over rapl:intel-rapl:0, whole devices; ~$0.00125")
    last = read_metrics(run / "metrics.jsonl")[-1]
    assert last["step"] == 2 and last["energy_kwh"] == pytest.approx(0.0025)
    board = EventAccumulator(str(run), size_guidance={"scalars": 0})
    board.Reload()
    assert [e.value for e in board.Scalars("energy_kwh")] == [pytest.approx(0.0025)]
    unread = run_energy(Reading(), Reading(missing=["RAPL: no /sys/class/powercap/intel-rapl:*"]), 0.5)
    assert run_energy_line(unread) == "energy not measured (RAPL: no /sys/class/powercap/intel-rapl:*)"
