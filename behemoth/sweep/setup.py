"""A sweep's directory: the trials a sweep file expands to, each one's validated config, and the record of what ran."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from behemoth.config import Config, load_config
from behemoth.errors import BehemothError
from behemoth.sweep.spec import SweepFile, Trial, base_source, expand, read_sweep_file


@dataclass
class SweepSetup:
    """Everything the runner needs: where the sweep lives, its trials and how they run."""

    path: Path
    spec: SweepFile
    dir: Path
    trials: list[Trial]
    nproc: int
    steps: dict[str, int] = field(default_factory=dict)  # trial -> train.steps
    tokens_per_step: dict[str, int] = field(default_factory=dict)

    def trial_dir(self, trial: str) -> Path:
        return self.dir / trial

    @property
    def events(self) -> Path:
        return self.dir / "events.jsonl"


def default_sweep_dir(path: Path) -> Path:
    return Path("runs") / "sweeps" / path.stem


def prepare(path: Path, overrides: list[str], nproc: int | None, *, resume: bool) -> SweepSetup:
    """Read the sweep file, expand its trials and validate every trial's config before anything runs; a new sweep
    writes its directory, a resumed one must find the same trials there."""
    if nproc is not None and nproc < 1:
        raise BehemothError(f"--nproc {nproc}: a trial runs on at least one process", "give --nproc 1 or more, or leave it out (sweep.nproc, else 1)")
    spec = read_sweep_file(path)
    sweep_dir = Path(spec.sweep.dir) if spec.sweep.dir else default_sweep_dir(path)
    trials = expand(spec)
    setup = SweepSetup(path, spec, sweep_dir, trials, nproc or spec.sweep.nproc or 1)
    recorded = sweep_dir / "trials.json"
    if resume and overrides:
        raise BehemothError(
            f"--resume continues {sweep_dir} with the options it started with, not {' '.join(overrides)}", "drop the options, or start a new sweep"
        )
    if resume and not recorded.is_file():
        raise BehemothError(f"--resume: {sweep_dir} holds no sweep (no trials.json)", f"start it without --resume: behemoth sweep {path}")
    if not resume and recorded.is_file():
        raise BehemothError(f"{sweep_dir} already holds a sweep", f"continue it with behemoth sweep {path} --resume, or set sweep.dir elsewhere")
    if resume:
        check_same_trials(setup, json.loads(recorded.read_text()))
    configs = trial_configs(setup, overrides)
    for trial in trials:
        cfg = configs[trial.name]
        setup.steps[trial.name] = cfg.train.steps
        setup.tokens_per_step[trial.name] = cfg.train.global_batch * cfg.seq_len
    if not resume:
        write_sweep_dir(setup, configs)
    return setup


def trial_configs(setup: SweepSetup, overrides: list[str]) -> dict[str, Config]:
    """Each trial's full config: the base, the command line's options, the trial's own, its run directory."""
    base_file, inline = base_source(setup.spec, setup.path)
    if base_file is None:
        setup.dir.mkdir(parents=True, exist_ok=True)
        base_file = str(setup.dir / "base.yaml")
        Path(base_file).write_text(yaml.safe_dump(inline, sort_keys=False))
    out = {}
    for trial in setup.trials:
        run = [f"run.dir={setup.trial_dir(trial.name)}", "run.progress=false"]
        try:
            out[trial.name] = load_config(base_file, [*overrides, *trial.args(), *run])
        except BehemothError as err:
            raise BehemothError(f"{trial.name} ({trial.diff()}): {err}") from None
    return out


def write_sweep_dir(setup: SweepSetup, configs: dict[str, Config]) -> None:
    setup.dir.mkdir(parents=True, exist_ok=True)
    (setup.dir / "sweep.yaml").write_text(setup.path.read_text())
    for trial in setup.trials:
        folder = setup.trial_dir(trial.name)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "trial.yaml").write_text(configs[trial.name].to_yaml())
    record = [{"name": t.name, "overrides": t.overrides} for t in setup.trials]
    write_atomic(setup.dir / "trials.json", json.dumps(record, indent=1) + "\n")


def check_same_trials(setup: SweepSetup, recorded: list[dict[str, Any]]) -> None:
    """A resumed sweep runs the trials it started with: a sweep file that now expands differently is refused."""
    now = [{"name": t.name, "overrides": t.overrides} for t in setup.trials]
    if json.loads(json.dumps(now)) != recorded:
        changed = next((r["name"] for r, n in zip(recorded, now) if r != n), f"{len(recorded)} trials then, {len(now)} now")
        raise BehemothError(
            f"--resume: {setup.path} no longer expands to the trials {setup.dir} holds ({changed} differs)",
            "restore the sweep file, or start a new sweep with another sweep.dir",
        )


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_events(path: Path) -> list[dict[str, Any]]:
    """The sweep's log of finished segments; a line cut short by a kill is dropped."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def append_event(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())
