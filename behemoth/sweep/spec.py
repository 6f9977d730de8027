"""A sweep file: a base config, the values to try (grid, list, random sample) and how to run the trials."""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from behemoth.config import check_key
from behemoth.errors import BehemothError

RESERVED = {"run.dir": "each trial's run directory is chosen by the sweep", "train.stop_at": "the sweep sets it for its rungs"}
DISTRIBUTIONS = ("choice", "uniform", "loguniform", "int")


class SweepSection(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PruneSpec(SweepSection):
    """Successive halving on validation loss: rungs at min_steps * eta**k steps; the top 1/eta of a rung go on."""

    method: Literal["asha", "sha"] = Field("asha", description="asha: promote as soon as a trial is in its rung's top 1/eta; sha: wait for the rung")
    min_steps: int = Field(ge=1, description="steps of the first rung")
    reduction_factor: int = Field(3, ge=2, description="eta: one trial in eta goes on to the next rung, which runs eta times as many steps")


class RaySpec(SweepSection):
    address: str | None = Field(None, description="a running Ray cluster (ray.init(address=...)); default: a local instance on 127.0.0.1")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the local instance (default: this machine's cores)")


class HydraSpec(SweepSection):
    budget_mb: float | None = Field(None, gt=0, description="each worker's device budget for model states, MiB (default: none, a trial is one shard)")
    spill: Literal["host", "disk"] = Field("host", description="where shards wait while they do not run: shared host memory, or files")
    join: bool = Field(True, description="idle workers join ready trials by data parallelism (results equal up to the gradient sum's reassociation)")


class SweepOptions(SweepSection):
    dir: str | None = Field(None, description="the sweep directory (default runs/sweeps/<sweep file name>)")
    execution: Literal["sequential", "concurrent", "hydra"] = Field(
        "sequential", description="one trial at a time, several sharing the machine, or hydra: every trial's shards scheduled over --nproc workers"
    )
    concurrency: int | None = Field(None, ge=1, description="trials at once (concurrent, ray; default: devices or cores / nproc)")
    nproc: int | None = Field(None, ge=1, description="processes per trial (default 1; --nproc overrides)")
    backend: Literal["local", "ray"] = Field("local", description="local: processes of this machine; ray: Ray tasks on a Ray cluster")
    prune: PruneSpec | None = None
    ray: RaySpec = Field(default_factory=RaySpec)
    hydra: HydraSpec = Field(default_factory=HydraSpec)


class RandomSpec(SweepSection):
    samples: int = Field(ge=1, description="points drawn")
    seed: int = Field(0, description="seeds the draws: the same file gives the same trials")
    params: dict[str, dict[str, Any]] = Field(min_length=1, description="key: {choice: [...]}, {uniform: [lo, hi]}, {loguniform: ...} or {int: ...}")


class SweepFile(SweepSection):
    sweep: SweepOptions = Field(default_factory=SweepOptions)
    base: dict[str, Any] | str | None = Field(None, description="the config every trial starts from: inline, or a YAML file")
    grid: dict[str, list[Any]] | None = None
    entries: list[dict[str, Any]] | None = Field(None, alias="list", description="trials given one by one: [{key: value, ...}, ...]")
    random: RandomSpec | None = None


@dataclass(frozen=True)
class Trial:
    """One point of the sweep: its name and the options it sets on the base config."""

    name: str
    overrides: dict[str, Any]

    def args(self) -> list[str]:
        """The trial's options as `key=value` arguments of `behemoth train`."""
        return [f"{key}={override_text(value)}" for key, value in self.overrides.items()]

    def diff(self) -> str:
        return " ".join(f"{k}={short(v)}" for k, v in self.overrides.items()) or "(base)"


def override_text(value: Any) -> str:
    """A value as `key=value` text that YAML reads back to the same value."""
    if isinstance(value, str) and yaml.safe_load(value) == value:
        return value
    return json.dumps(value)


def short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else override_text(value)


def read_sweep_file(path: Path) -> SweepFile:
    if not path.is_file():
        raise BehemothError(f"sweep file {path} does not exist", "pass a YAML file with base: and grid:/list:/random: (docs/sweep.md)")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise BehemothError(f"sweep file {path} is not valid YAML ({err.__class__.__name__})", "fix the syntax") from None
    if not isinstance(raw, dict):
        raise BehemothError(f"sweep file {path} holds a {type(raw).__name__}, not a mapping", "write sweep:, base:, grid: ... (docs/sweep.md)")
    try:
        return SweepFile.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise BehemothError(f"{path}: {where}={first.get('input')!r}: {first['msg']}", "see docs/sweep.md for the sweep file's format") from None


def check_keys(keys: list[str], where: str) -> None:
    """Every swept key names a config option (`model` is short for model.preset) and none the sweep sets itself."""
    for key in keys:
        if key in RESERVED:
            raise BehemothError(f"{where}: {key} cannot be swept ({RESERVED[key]})", f"remove {key} from {where}")
        parts = key.split(".")
        check_key(["model", "preset"] if parts == ["model"] else parts)


def expand(spec: SweepFile) -> list[Trial]:
    """The trials: the cross product of the grid's points, the list's entries and the random draws (each part that is
    absent contributes one empty point), named trial-000, trial-001, ... in that order."""
    parts = [grid_points(spec.grid), list_points(spec.entries), random_points(spec.random)]
    trials = []
    for combo in itertools.product(*parts):
        merged: dict[str, Any] = {}
        for point in combo:
            for key in point.keys() & merged.keys():
                raise BehemothError(f"{key} is set by two parts of the sweep (grid, list, random)", f"set {key} in one of them")
            merged.update(point)
        trials.append(merged)
    width = max(3, len(str(len(trials) - 1)))
    return [Trial(f"trial-{i:0{width}d}", point) for i, point in enumerate(trials)]


def grid_points(grid: dict[str, list[Any]] | None) -> list[dict[str, Any]]:
    if not grid:
        return [{}]
    check_keys(list(grid), "grid")
    for key, values in grid.items():
        if not values:
            raise BehemothError(f"grid: {key} has no values", f"give {key} a list of at least one value")
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def list_points(entries: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    if not entries:
        return [{}]
    for i, entry in enumerate(entries):
        check_keys(list(entry), f"list[{i}]")
    return [dict(entry) for entry in entries]


def random_points(spec: RandomSpec | None) -> list[dict[str, Any]]:
    if spec is None:
        return [{}]
    check_keys(list(spec.params), "random.params")
    rng = random.Random(spec.seed)
    return [{key: draw(rng, key, dist) for key, dist in spec.params.items()} for _ in range(spec.samples)]


def draw(rng: random.Random, key: str, dist: dict[str, Any]) -> Any:
    """One value of `key` from its distribution: {choice: [...]}, {uniform: [lo, hi]}, {loguniform: [lo, hi]}, {int: [lo, hi]}."""
    if len(dist) != 1 or next(iter(dist)) not in DISTRIBUTIONS:
        raise BehemothError(f"random.params.{key}={dist!r} is not one distribution", f"write {key}: {{one of {', '.join(DISTRIBUTIONS)}: ...}}")
    kind, args = next(iter(dist.items()))
    if kind == "choice":
        if not isinstance(args, list) or not args:
            raise BehemothError(f"random.params.{key}.choice={args!r} is not a non-empty list", f"write {key}: {{choice: [a, b]}}")
        return args[rng.randrange(len(args))]
    if not (isinstance(args, list) and len(args) == 2 and all(isinstance(a, (int, float)) for a in args) and args[0] <= args[1]):
        raise BehemothError(f"random.params.{key}.{kind}={args!r} is not [low, high] with low <= high", f"write {key}: {{{kind}: [low, high]}}")
    low, high = args
    if kind == "int":
        return rng.randint(math.ceil(low), math.floor(high))
    if kind == "uniform":
        return rng.uniform(low, high)
    if low <= 0:
        raise BehemothError(f"random.params.{key}.loguniform={args!r} needs low > 0", f"write {key}: {{loguniform: [1e-4, 1e-2]}}")
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def base_source(spec: SweepFile, sweep_path: Path) -> tuple[str | None, dict[str, Any]]:
    """The base config: a YAML file (relative to the sweep file, else to the working directory) or inline options."""
    if isinstance(spec.base, str):
        for candidate in (sweep_path.parent / spec.base, Path(spec.base)):
            if candidate.is_file():
                return str(candidate), {}
        raise BehemothError(f"base: {spec.base} is not a file (next to {sweep_path} or here)", "give a config YAML file, or the options inline")
    return None, dict(spec.base or {})
