"""Hydra execution of a sweep (`sweep.execution=hydra`): every trial, cut into shards that its device budget holds and
scheduled shard by shard over two workers, ends with exactly the losses, validation losses and weights of the same
trial trained alone by `behemoth train`; its states are over 4x the budget while the model states a worker holds stay
within it; a trial that diverges is reported failed while the others finish."""

from __future__ import annotations

import contextlib
import json
import signal

import pytest
import torch
from safetensors.torch import load_file

from behemoth.cli import main
from behemoth.errors import BehemothError
from behemoth.models.causal_lm import build_causal_lm
from behemoth.models.gpt import GPTConfig
from behemoth.sweep.hydra.shards import FIRST, LAST, plan_shards
from tests.test_sweep_run import alone, base, corpus, csv_rows, curve, run_killed, write_sweep  # noqa: F401 - corpus is a fixture

BUDGET_MB = 0.4  # a block of the 8-layer, 32-wide GPT holds 0.19 MiB of states: one block a shard (half the budget)
DEEP = {"model": {"preset": "gpt-tiny", "n_layer": 8, "tie_embeddings": True}}


@contextlib.contextmanager
def deadline(seconds: int):
    """A hydra sweep run in this process that has not ended within `seconds` fails (a hang in the scheduler's wait,
    with its workers stopped as it unwinds) instead of hanging the suite."""

    def expire(signum, frame):
        raise TimeoutError(f"the hydra sweep ran over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def deep_lm(tied: bool = True):
    return build_causal_lm(GPTConfig(preset="gpt-tiny", n_layer=8, tie_embeddings=tied))


def test_shards_are_consecutive_pieces_within_half_the_budget():
    budget = int(BUDGET_MB * 2**20)
    for tied in (True, False):
        plan = plan_shards(deep_lm(tied), budget)
        pieces = [p for s in plan.shards for p in s.pieces]
        assert pieces == [FIRST, *range(8), LAST]
        assert all(plan.resident_bytes(s) <= budget // 2 for s in plan.shards) and len(plan.shards) == 10
        names = [n for s in plan.shards for n in s.names]
        assert names == list(dict(deep_lm(tied).module.named_parameters()))  # every parameter once, in the model's order
        assert plan.state_bytes >= 4 * budget
        assert (plan.shards[-1].borrowed == "wte.weight") == tied  # the tied head reads the embedding's weight
    assert len(plan_shards(deep_lm(), None).shards) == 1  # no budget: the whole model is one shard
    with pytest.raises(BehemothError, match=r"piece 'first' .* raise sweep.hydra.budget_mb to at least"):
        plan_shards(deep_lm(), 2**18)


def test_a_trial_hydra_cannot_run_exactly_is_refused_before_launch(corpus, tmp_path, capsys):  # noqa: F811
    cfg = base(corpus, 2, train={"precision": "bf16"})
    path = write_sweep(tmp_path / "s.yaml", {"dir": str(tmp_path / "sw"), "execution": "hydra"}, cfg)
    assert main(["sweep", str(path)]) == 2
    assert "trial-000 ((base)): hydra execution does not run precision bf16" in capsys.readouterr().err
    cfg["train"]["precision"] = "fp32"  # fixed, but with a budget too small: refused again, not as a sweep to --resume
    path = write_sweep(tmp_path / "s.yaml", {"dir": str(tmp_path / "sw"), "execution": "hydra", "hydra": {"budget_mb": 0.01}}, cfg)
    assert main(["sweep", str(path)]) == 2
    assert "raise sweep.hydra.budget_mb to at least" in capsys.readouterr().err and not (tmp_path / "sw" / "trials.json").exists()


@pytest.fixture(scope="module")
def hydra_sweep(corpus, tmp_path_factory):  # noqa: F811
    """Three trials of an 8-block GPT on two workers: tied (two micro-batches a step), untied, and one that diverges."""
    root = tmp_path_factory.mktemp("hydra")
    cfg = base(corpus, 3, **DEEP, train={"eval_every": 3, "micro_batch": 4}, checkpoint={"export": True})
    trials = [{"train.lr": 0.01}, {"train.lr": 0.003, "model.tie_embeddings": False}, {"train.lr": 1e30}]
    sweep = {"dir": str(root / "sweep"), "execution": "hydra", "hydra": {"budget_mb": BUDGET_MB, "join": False}}  # bit for bit
    path = write_sweep(root / "hydra.yaml", sweep, cfg, list=trials)
    with deadline(600):
        code = main(["sweep", str(path), "--nproc", "2"])
    return root, code


def test_hydra_trials_end_with_the_losses_and_weights_they_have_alone(hydra_sweep):
    root, code = hydra_sweep
    sweep = root / "sweep"
    assert code == 1  # the diverging trial failed; the sweep says so after finishing the others
    for trial in ("trial-000", "trial-001"):
        expected = alone(sweep / trial, root / f"alone-{trial}")
        assert curve(sweep / trial) == expected and len(expected[0]) == 3 and len(expected[1]) == 2  # every loss, exactly
        ours, theirs = load_file(sweep / trial / "model.safetensors"), load_file(root / f"alone-{trial}" / "model.safetensors")
        assert sorted(ours) == sorted(theirs)
        for name, t in theirs.items():
            assert ours[name].equal(t), name  # every weight, bit for bit
    assert curve(sweep / "trial-000") != curve(sweep / "trial-001")


def test_hydra_holds_each_worker_to_its_budget(hydra_sweep):
    """The trials' model states are over 4x the budget; each worker's resident shards (the running one and the one
    prefetched, counted as loaded) never exceed it: margin 0 for model states (activations are not counted)."""
    root, _ = hydra_sweep
    report = json.loads((root / "sweep" / "hydra.json").read_text())
    budget = report["budget_bytes"]
    assert budget == int(BUDGET_MB * 2**20) and report["workers"] == 2
    for trial in ("trial-000", "trial-001"):
        assert report["trials"][trial]["state_bytes"] >= 4 * budget and report["trials"][trial]["shards"] == 10
    peaks = report["resident_peak_bytes"]
    assert all(0 < peak <= budget for peak in peaks), peaks
    assert max(peaks) > budget // 2  # a shard and the prefetched next were resident together
    assert all(busy > 0 for busy in report["busy_s"])  # both workers ran shards


def test_a_diverging_trial_is_reported_without_stopping_the_others(hydra_sweep):
    root, _ = hydra_sweep
    rows = {r["trial"]: r for r in csv_rows(root / "sweep" / "leaderboard.csv")}
    assert rows["trial-000"]["status"] == "done" and rows["trial-001"]["status"] == "done"
    assert rows["trial-002"]["status"].startswith("failed: step ") and "gradient norm is nan" in rows["trial-002"]["status"]
    log = (root / "sweep" / "sweep.log").read_text()
    assert "sweep: 3 trials, hydra on local" in log and "sweep: trial-002 failed before step 3" in log


def test_idle_workers_join_a_trial_by_data_parallelism(corpus, tmp_path):  # noqa: F811
    """One trial on two workers: every task of it is split by rows over both workers and the gradients summed; its
    losses and weights equal the trial alone up to that reduction's reassociation (float32: measured 2e-8 relative on
    losses and 2e-7 absolute on weights; held to 2e-6 both. Leaving out the second half's gradient, or adding a tied
    embedding's head gradient in both halves, fails by far more)."""
    model = {"preset": "gpt-tiny", "n_layer": 2, "tie_embeddings": True}
    cfg = base(corpus, 4, model=model, train={"lr": 0.003, "eval_every": 2, "micro_batch": 4}, checkpoint={"export": True})
    sweep = {"dir": str(tmp_path / "sweep"), "execution": "hydra", "hydra": {"budget_mb": BUDGET_MB}}
    with deadline(600):
        assert main(["sweep", str(write_sweep(tmp_path / "join.yaml", sweep, cfg)), "--nproc", "2"]) == 0
    report = json.loads((tmp_path / "sweep" / "hydra.json").read_text())
    trial = report["trials"]["trial-000"]
    assert trial["shards"] == 4 and trial["joined_tasks"] == 4 * 7 + 3 * 4  # every task: 4 steps of 7, 3 validations of 4
    assert all(0 < busy for busy in report["busy_s"]) and all(0 < peak <= report["budget_bytes"] for peak in report["resident_peak_bytes"])
    trial_dir = tmp_path / "sweep" / "trial-000"
    (train, val), (train_alone, val_alone) = curve(trial_dir), alone(trial_dir, tmp_path / "alone")
    assert [s for s, _ in train] == [s for s, _ in train_alone] == [1, 2, 3, 4] and len(val) == len(val_alone) == 3
    for (_, ours), (_, theirs) in zip(train + val, train_alone + val_alone):
        assert ours == pytest.approx(theirs, rel=2e-6, abs=0)
    ours_w, theirs_w = load_file(trial_dir / "model.safetensors"), load_file(tmp_path / "alone" / "model.safetensors")
    for name, t in theirs_w.items():
        torch.testing.assert_close(ours_w[name], t, rtol=0, atol=2e-6, msg=name)


@pytest.mark.slow  # a sweep killed and resumed, then the winner trained alone: ~40 s on a quiet 2-core machine (-m slow -k hydra)
def test_killed_hydra_sweep_with_successive_halving_resumes(corpus, tmp_path):  # noqa: F811
    """ASHA over 4 learning rates under hydra (shards spilled to disk), killed once the first trial's first rung is
    saved, then --resume: the winner (reloaded from its hydra/state.pt) ends with exactly the losses and weights of the
    trial alone."""
    cfg = base(corpus, 8, train={"eval_every": 2}, checkpoint={"export": True})
    sweep = {
        "dir": str(tmp_path / "sweep"),
        "execution": "hydra",
        "hydra": {"budget_mb": 0.45, "spill": "disk"},
        "prune": {"min_steps": 2, "reduction_factor": 2},
    }
    path = write_sweep(tmp_path / "asha.yaml", sweep, cfg, list=[{"train.lr": lr} for lr in (0.01, 0.003, 1e-7, 2e-7)])
    run_killed(path, tmp_path / "sweep" / "trial-000" / "hydra" / "state.pt")
    assert main(["sweep", str(path), "--resume"]) == 0
    rows = {r["trial"]: r["status"] for r in csv_rows(tmp_path / "sweep" / "leaderboard.csv")}
    assert rows["trial-000"] == "done" and rows["trial-002"] == "stopped at 2"
    events = [(e["trial"], e["step"]) for e in map(json.loads, (tmp_path / "sweep" / "events.jsonl").read_text().splitlines())]
    assert len(events) == len(set(events)) and ("trial-000", 8) in events
    trial = tmp_path / "sweep" / "trial-000"
    assert curve(trial) == alone(trial, tmp_path / "alone")
    ours, theirs = load_file(trial / "model.safetensors"), load_file(tmp_path / "alone" / "model.safetensors")
    assert all(ours[name].equal(t) for name, t in theirs.items())
