"""Where a (re)started worker resumes, and the plan it runs on the world it finds: the worker's half of self-healing.

torch's elastic agent (behemoth's local launcher, or torchrun with `--max-restarts`) starts the workers again after a
failure or a change of nodes, possibly on another WORLD_SIZE. Each launch has an id (behemoth's launcher makes one;
under torchrun it is the rendezvous id); the job's rank 0 records it in the run directory (`.launch`) when the launch
first starts. A start that finds its own id there is a restart: it resumes from the run's newest intact checkpoint
(its `latest`, or the newest step folder that verifies), else from where the launch began. (The agents' restart
counts cannot decide this: after one node's failure the other nodes restart for the change of members, uncounted.)
On a new world size the plan keeps its pipeline and tensor degrees and data parallelism absorbs the change; the
checkpoint, saved under single-process names, reshards on load. Every rank agrees on one checkpoint: rank 0
chooses and verifies it, and broadcasts the choice.
"""

from __future__ import annotations

import os
from pathlib import Path

from behemoth.comm import broadcast_object
from behemoth.config import Config, default_run_dir
from behemoth.errors import BehemothError
from behemoth.faults import checkpoint as ckpt_io
from behemoth.faults.integrity import verify
from behemoth.topology import Runtime


def restart_count() -> int:
    """How many times the elastic agent has restarted this run's workers (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def plan_for_world(cfg: Config, world: int) -> Config:
    """`cfg` on `world` processes: as configured where its degrees fit, else with data parallelism absorbing the change
    (an explicit parallel.dp dropped); a plan that still cannot run is left for `problems` to refuse."""
    if not cfg.parallel.dims_problems(world) or cfg.parallel.dp is None:
        return cfg
    adapted = cfg.replace(parallel={"dp": None})
    return adapted if not adapted.parallel.dims_problems(world) else cfg


def settle_run_dir(cfg: Config, rt: Runtime) -> Config:
    """Give a torchrun job without run.dir one name on every rank and across restarts: runs/torchrun-<rdzv id>, or
    (torchrun's static rendezvous has no id) a timestamp chosen by the job's rank 0."""
    if cfg.run.dir:
        return cfg
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    name = f"runs/torchrun-{run_id}" if run_id not in ("", "none") else broadcast_object(default_run_dir, rt.world_group, rt.is_main)
    return cfg.replace(run={"dir": name})


def resume_point(cfg: Config, given: Path | None, rt: Runtime, *, launch_id: str, verified: bool) -> Path | None:
    """The checkpoint this start of launch `launch_id` resumes from, the same on every rank: on a restart the run's newest
    intact one (else where the launch began); on the first start `given`, verified here unless the launcher did."""

    def choose() -> tuple[str, str | None]:
        try:
            return "ok", _choose(cfg, given, launch_id, verified)
        except BehemothError as err:
            return "error", str(err)

    status, value = broadcast_object(choose, rt.world_group, rt.is_main)
    if status == "error":
        raise BehemothError(value or "no checkpoint to resume from")
    return Path(value) if value else None


def _choose(cfg: Config, given: Path | None, launch_id: str, verified: bool) -> str | None:
    run_dir = Path(cfg.run.dir or "runs/unnamed")
    marker = run_dir / ".launch"
    if marker.is_file() and marker.read_text().strip() == launch_id:  # a restart within this launch
        found = newest_of_run(ckpt_io.checkpoint_root(run_dir))
        if found is not None:
            return str(found)
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        marker.write_text(launch_id + "\n")
    if given is not None and not verified:
        ckpt_io.validate_checkpoint(given, cfg.model.model_dump(mode="json"))
    return str(given) if given is not None else None


def newest_of_run(root: Path) -> Path | None:
    """The checkpoint `latest` names if it verifies, else the newest step folder that does, else None."""
    if not root.is_dir():
        return None
    try:
        latest = ckpt_io.resolve_checkpoint(root)
        verify(latest)
        return latest
    except BehemothError:
        return ckpt_io.newest_intact(root)


def torchrun_restart_warning() -> str | None:
    """Under torchrun with restarts, the one setting that keeps restarted gloo workers from reading the previous
    attempt's addresses out of the agent's shared store (torch keeps one store for every round; behemoth's own
    launcher makes a new one each round, and marks its workers with BEHEMOTH_LAUNCHER)."""
    if (
        int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") != "1"
        and "BEHEMOTH_LAUNCHER" not in os.environ
    ):
        return (
            "behemoth: warning: torchrun --max-restarts shares one store across restarts, where a restarted worker can find a "
            "dead one's address; set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (and TORCH_GLOO_LAZY_INIT=1) in torchrun's environment"
        )
    return None
