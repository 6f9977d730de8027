"""Elastic re-planning: a restart on a world size other than the checkpoint's runs the planner's plan for that world.

Without it (`elastic.replan=false`, the default) a restarted job keeps its pipeline and tensor degrees and data
parallelism absorbs the change (faults/recovery.py `plan_for_world`), which runs only where the old degrees divide the
new world and is rarely the best layout for it. With it, the job's rank 0 — after the rendezvous, on the process group
every worker has joined — asks the planner for the best plan of the new world (`replan`: the search of `behemoth plan`
on this machine's cluster description, every degree free, options outside the layout kept), and broadcasts it
(`decided_once`); every rank builds that plan, and the checkpoint, saved under single-process names, reshards on load.
The first start of a launch, and a restart on the checkpoint's own world size, run the config's plan as written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from behemoth.config import Config
from behemoth.errors import BehemothError
from behemoth.faults import checkpoint as ckpt_io
from behemoth.faults.elastic import decided_once
from behemoth.faults.recovery import newest_of_run, plan_for_world
from behemoth.planner.cluster import ClusterSpec
from behemoth.planner.layout import Layout, Offload, Workload
from behemoth.planner.search import Space, config_of, search


def replan(cfg: Config, world: int, cluster: ClusterSpec | None = None) -> Config:
    """`cfg` with the planner's best plan for `world` processes (on `cluster`, default this machine as calibrated or
    probed): the degrees, ZeRO stage, schedule and micro-batches chosen anew, a user's offload placement kept."""
    cluster = (cluster or this_machine(world)).with_nodes(world)
    space = Space(offload=(Offload.of(cfg),)) if cfg.offload.enabled else Space()
    result = search(Workload.of(cfg), cluster, world, space, cfg=cfg, top=1, exact=1)
    if not result.ranked:
        raise BehemothError(
            f"elastic.replan=true: no plan of the model fits {world} process(es) of {cluster.name}",
            "restart on more processes, or set elastic.replan=false to keep the old degrees",
        )
    best = result.ranked[0]
    return config_of(cfg, best.layout.but(boundaries=best.bounds))


def this_machine(world: int) -> ClusterSpec:
    """This machine for `world` processes: `behemoth calibrate`'s cached description, or a probe where there is none or
    it cannot be read (a restart must not fail on a stale cache)."""
    from behemoth.planner.calibrate import local_cluster, probe_spec

    try:
        return local_cluster(world)
    except BehemothError:
        return probe_spec(world)


def saved_world(cfg: Config, launch_id: str) -> int | None:
    """The world size of the checkpoint a restart within launch `launch_id` resumes from (None on a first start, or
    without a checkpoint): the run's newest intact one, as `resume_point` will choose."""
    if not cfg.run.dir:
        return None
    marker = Path(cfg.run.dir) / ".launch"
    if not marker.is_file() or marker.read_text().strip() != launch_id:
        return None
    found = newest_of_run(ckpt_io.checkpoint_root(cfg.run.dir))
    return int(ckpt_io.read_meta(found)["world_size"]) if found is not None else None


def plan_of_restart(cfg: Config, world: int, launch_id: str) -> tuple[dict[str, Any], str]:
    """Rank 0's decision: (the config to run, as JSON, and one line saying what was chosen and why)."""
    before = saved_world(cfg, launch_id)
    if before is None or before == world:
        return plan_for_world(cfg, world).model_dump(mode="json"), ""
    chosen = replan(cfg, world)
    line = f"behemoth: elastic.replan: {before} -> {world} processes, re-planned as {Layout.of_config(chosen, world).describe()}"
    return chosen.model_dump(mode="json"), line


def agreed_plan(cfg: Config, world: int, launch_id: str, group: dist.ProcessGroup, is_source: bool) -> tuple[Config, str]:
    """The config every rank of `group` runs on this start: decided once, on the source rank, and broadcast."""
    data, line = decided_once(lambda: plan_of_restart(cfg, world, launch_id), group, is_source)
    return Config.model_validate(data), line
