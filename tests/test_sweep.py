"""Sweep files and the halving policy, without training: which trials a file expands to, which trials successive halving
runs to which step given their validation losses, and the one-line refusals of bad sweep files."""

from __future__ import annotations

import math

import pytest
import yaml

from behemoth.errors import BehemothError
from behemoth.sweep.halving import Halving, Policy, make_policy, rung_steps
from behemoth.sweep.spec import SweepFile, expand, read_sweep_file


def spec(**parts) -> SweepFile:
    return SweepFile.model_validate(parts)


def test_grid_list_and_random_expand_to_their_cross_product():
    trials = expand(
        spec(
            grid={"train.lr": [1e-3, 3e-3], "model.n_layer": [1, 2]},
            list=[{"train.seed": 1}, {"train.seed": 2, "train.warmup_steps": 0}],
            random={"samples": 2, "seed": 7, "params": {"train.weight_decay": {"uniform": [0.0, 0.2]}}},
        )
    )
    assert len(trials) == 2 * 2 * 2 * 2 and [t.name for t in trials[:2]] == ["trial-000", "trial-001"]
    assert trials[0].overrides["train.lr"] == 1e-3 and trials[0].overrides["model.n_layer"] == 1
    assert trials[1].overrides["model.n_layer"] == 1 and trials[1].overrides["train.weight_decay"] != trials[0].overrides["train.weight_decay"]
    assert trials[2].overrides == {**trials[0].overrides, "train.seed": 2, "train.warmup_steps": 0}
    assert {(t.overrides["train.lr"], t.overrides["model.n_layer"]) for t in trials} == {(a, b) for a in (1e-3, 3e-3) for b in (1, 2)}
    assert trials[0].args()[:2] == ["train.lr=0.001", "model.n_layer=1"]


def test_random_draws_are_seeded_and_stay_in_their_ranges():
    params = {
        "train.lr": {"loguniform": [1e-4, 1e-2]},
        "model.n_layer": {"int": [1, 3]},
        "train.warmup_steps": {"choice": [0, 5]},
        "train.weight_decay": {"uniform": [0.0, 0.1]},
    }
    draws = [t.overrides for t in expand(spec(random={"samples": 40, "seed": 3, "params": params}))]
    assert draws == [t.overrides for t in expand(spec(random={"samples": 40, "seed": 3, "params": params}))]
    assert draws != [t.overrides for t in expand(spec(random={"samples": 40, "seed": 4, "params": params}))]
    assert all(1e-4 <= d["train.lr"] <= 1e-2 and d["model.n_layer"] in (1, 2, 3) and d["train.warmup_steps"] in (0, 5) for d in draws)
    logs = [math.log10(d["train.lr"]) for d in draws]
    assert min(logs) < -3.3 and max(logs) > -2.7  # log-uniform: both decades drawn
    assert {d["model.n_layer"] for d in draws} == {1, 2, 3}


@pytest.mark.parametrize(
    "parts, message",
    [
        ({"grid": {"train.lrr": [1]}}, "unknown option train.lrr; did you mean train.lr?"),
        ({"grid": {"run.dir": ["a"]}}, "grid: run.dir cannot be swept"),
        ({"grid": {"train.lr": []}}, "grid: train.lr has no values"),
        ({"grid": {"train.lr": [1]}, "list": [{"train.lr": 2}]}, "train.lr is set by two parts of the sweep"),
        ({"random": {"samples": 1, "params": {"train.lr": {"normal": [0, 1]}}}}, "is not one distribution"),
        ({"random": {"samples": 1, "params": {"train.lr": {"uniform": [2, 1]}}}}, "is not [low, high] with low <= high"),
        ({"random": {"samples": 1, "params": {"train.lr": {"loguniform": [0, 1]}}}}, "needs low > 0"),
    ],
)
def test_bad_sweeps_are_refused_in_one_line(parts, message):
    with pytest.raises(BehemothError, match=None) as err:
        expand(spec(**parts))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_sweep_file_names_the_key(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"sweep": {"execution": "parallel"}}))
    with pytest.raises(BehemothError, match=r"sweep.execution='parallel': Input should be 'sequential', 'concurrent' or 'hydra'"):
        read_sweep_file(path)


def test_rungs():
    assert rung_steps(4, 2, 16) == [4, 8, 16]
    assert rung_steps(3, 3, 20) == [3, 9, 20]
    with pytest.raises(BehemothError, match="prune.min_steps=16 is not below train.steps=16"):
        rung_steps(16, 2, 16)


def drive(policy: Policy, loss: dict[str, float], slots: int = 1) -> list[tuple[str, int]]:
    """Run a policy to its end with `slots` segments at a time, each trial's validation loss at step s being loss[t] / s;
    the segments in the order they ran."""
    ran, running = [], []
    while True:
        while len(running) < slots and (job := policy.next_job()) is not None:
            running.append(job)
        if not running:
            return ran
        trial, step = running.pop(0)
        ran.append((trial, step))
        policy.report(trial, step, loss[trial] / step)


LOSSES = {"a": 5.0, "b": 4.0, "c": 9.0, "d": 8.0, "e": 7.0, "f": 3.0, "g": 6.0, "h": 10.0}


@pytest.mark.parametrize("method", ["asha", "sha"])
@pytest.mark.parametrize("slots", [1, 3])
def test_successive_halving_keeps_the_best_half_at_each_rung(method, slots):
    names = list(LOSSES)
    prune = spec(sweep={"prune": {"method": method, "min_steps": 4, "reduction_factor": 2}}).sweep.prune
    policy = make_policy(names, dict.fromkeys(names, 16), prune)
    ran = drive(policy, LOSSES, slots)
    reached = {t: policy.reached(t) for t in names}
    assert reached == {"f": 16, "b": 16, "a": 8, "g": 8, "c": 4, "d": 4, "e": 4, "h": 4}, ran
    assert {policy.status(t) for t in names if t not in "fb"} == {"stopped"} and policy.status("f") == policy.status("b") == "done"
    assert policy.finished()
    if method == "sha":  # synchronous: every trial finishes rung 1 before anything is promoted
        assert [s for _, s in ran[:8]] == [4] * 8


def test_asha_promotes_before_its_rung_fills():
    names = list(LOSSES)
    policy = Halving(names, dict.fromkeys(names, 16), min_steps=4, eta=2, method="asha")
    ran = drive(policy, LOSSES)
    assert ran[:3] == [("a", 4), ("b", 4), ("b", 8)]  # b is the best of two at rung 1: promoted at once


def test_failed_trials_are_not_ranked_and_policy_without_pruning_runs_each_once():
    policy = Halving(["a", "b", "c"], dict.fromkeys("abc", 8), min_steps=2, eta=2, method="sha")
    for _ in range(3):
        trial, step = policy.next_job()
        policy.fail(trial) if trial == "a" else policy.report(trial, step, {"b": 2.0, "c": 1.0}[trial])
    assert policy.next_job() == ("c", 4) and policy.status("a") == "failed" and policy.status("b") == "stopped"
    plain = Policy(["x", "y"], {"x": 5, "y": 7})
    assert plain.next_job() == ("x", 5) and plain.next_job() == ("y", 7) and plain.next_job() is None


def test_pruning_needs_one_length():
    with pytest.raises(BehemothError, match="prune: needs every trial to have the same train.steps"):
        make_policy(["a", "b"], {"a": 8, "b": 16}, spec(sweep={"prune": {"min_steps": 2}}).sweep.prune)


def test_a_new_sweep_is_refused_over_an_old_one_and_resume_needs_one(tmp_path):
    from behemoth.sweep.setup import prepare

    path = tmp_path / "s.yaml"
    cfg = {"model": {"preset": "gpt-tiny"}, "train": {"steps": 4}}
    path.write_text(yaml.safe_dump({"sweep": {"dir": str(tmp_path / "sw")}, "base": cfg, "grid": {"train.lr": [0.1, 0.2]}}))
    with pytest.raises(BehemothError, match="holds no sweep"):
        prepare(path, [], 1, resume=True)
    with pytest.raises(BehemothError, match=r"--nproc 0: a trial runs on at least one process; give --nproc 1 or more"):
        prepare(path, [], 0, resume=False)
    assert not (tmp_path / "sw").exists()  # refused before anything is written
    setup = prepare(path, [], 1, resume=False)
    assert [t.name for t in setup.trials] == ["trial-000", "trial-001"] and (setup.dir / "trial-001" / "trial.yaml").is_file()
    assert yaml.safe_load((setup.dir / "trial-001" / "trial.yaml").read_text())["train"]["lr"] == 0.2
    with pytest.raises(BehemothError, match="already holds a sweep; continue it with"):
        prepare(path, [], 1, resume=False)
    with pytest.raises(BehemothError, match="--resume continues .* with the options it started with"):
        prepare(path, ["train.steps=8"], 1, resume=True)
    path.write_text(yaml.safe_dump({"sweep": {"dir": str(tmp_path / "sw")}, "base": cfg, "grid": {"train.lr": [0.1, 0.3]}}))
    with pytest.raises(BehemothError, match=r"no longer expands to the trials .* holds \(trial-001 differs\)"):
        prepare(path, [], 1, resume=True)
    with pytest.raises(BehemothError, match=r"trial-000 \(train.lr=-1\): train.lr=-1: Input should be greater than 0"):
        path.write_text(yaml.safe_dump({"sweep": {"dir": str(tmp_path / "other")}, "base": cfg, "grid": {"train.lr": [-1]}}))
        prepare(path, [], 1, resume=False)
