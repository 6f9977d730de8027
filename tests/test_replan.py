"""Elastic re-planning: a restart on a world size other than the checkpoint's runs the plan rank 0's planner chose for
that world, the same on every rank (broadcast, not decided per rank); and, slow, a job that loses 1 of 4 workers
continues on 3 with the planner's layout, its losses equal to a run restarted by hand from the same checkpoint on it.

The slow test: `OMP_NUM_THREADS=1 python -m pytest -q -m slow tests/test_replan.py` (about 2-4 minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from behemoth.config import Config, load_config
from behemoth.planner.cluster import load_cluster
from tests.chaos import TINY, descendants, reaped, start, wait_for_step, workers
from tests.common import train_body
from tests.dist import run_ranks

LAUNCH = "replan-test-launch"


def cluster_file(folder: Path, nproc: int) -> None:
    """A calibration cache for `nproc` local processes holding A100 figures (one node of `nproc`): the cluster the
    planner reads on rank 0, the same for the test's own reference plan."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = load_cluster("a100-80gb").model_copy(update={"devices_per_node": nproc, "name": "replan-test"})
    (folder / f"cluster-local-{nproc}.yaml").write_text(spec.to_yaml())


def agree(cfgs: list[dict], cache: str) -> dict:
    """One rank: the config `agreed_plan` gives it for 2 processes, from its own (possibly different) config."""
    import torch.distributed as dist

    from behemoth.planner.replan import agreed_plan

    os.environ["BEHEMOTH_CACHE"] = cache
    rank = dist.get_rank()
    cfg, line = agreed_plan(Config.model_validate(cfgs[rank]), 2, LAUNCH, dist.group.WORLD, rank == 0)
    return {"config": cfg.model_dump(mode="json"), "line": line}


def test_every_rank_runs_the_plan_rank_0_chose_for_the_new_world(tmp_path):
    """A checkpoint saved on 1 process, a restart of its launch on 2 with elastic.replan=true: rank 0 plans for 2
    (its cluster says A100s, where the planner drops the config's pipeline) and rank 1, whose own config would not
    re-plan (another run directory, no checkpoint), receives and runs rank 0's plan; both equal the planner's choice."""
    from behemoth.faults.recovery import plan_for_world
    from behemoth.planner.replan import replan

    run = tmp_path / "run"
    base = [*TINY, "parallel.pp=2", "train.steps=2", "checkpoint.every=2", "checkpoint.async_save=false", f"run.dir={run}", "elastic.replan=true"]
    cfg = load_config(None, base)
    run_ranks(1, train_body, load_config(None, [*base, "parallel.pp=1"]).model_dump(mode="json"))  # the checkpoint, saved on 1 process
    (run / ".launch").write_text(LAUNCH + "\n")
    cluster_file(tmp_path / "cache", 2)
    other = cfg.replace(run={"dir": str(tmp_path / "elsewhere")})
    got = run_ranks(2, agree, [cfg.model_dump(mode="json"), other.model_dump(mode="json")], str(tmp_path / "cache"))
    assert got[0]["config"] == got[1]["config"]
    expected = replan(cfg, 2, load_cluster(tmp_path / "cache" / "cluster-local-2.yaml"))
    assert got[0]["config"]["parallel"] == expected.model_dump(mode="json")["parallel"]
    assert expected.parallel != plan_for_world(cfg, 2).parallel  # re-planning changed the layout: the broadcast carried it
    assert "1 -> 2 processes, re-planned as" in got[0]["line"], got[0]


def resumed_on(run: Path, world: int) -> dict | None:
    """The last resume event on `world` processes in the run's log, once a step after it has been logged."""
    try:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    except (OSError, ValueError):
        return None
    events = [i for i, r in enumerate(rows) if r.get("event") == "resume" and r["world_size"] == world]
    return rows[events[-1]] if events and any("loss" in r for r in rows[events[-1] :]) else None


@pytest.mark.slow
def test_a_job_that_loses_a_worker_continues_on_the_planned_layout(tmp_path, monkeypatch):
    """`--nproc 3:4 elastic.replan=true` with a 2-stage pipeline (which 3 processes cannot keep): SIGKILL one node;
    within 60 s the job trains on 3 processes with the layout the planner chose for 3, and its losses from the resumed
    checkpoint on equal a run restarted by hand from that checkpoint with that layout (float32, relative 1e-5)."""
    run = tmp_path / "run"
    for n in (3, 4):
        cluster_file(tmp_path / "cache", n)
    monkeypatch.setenv("BEHEMOTH_CACHE", str(tmp_path / "cache"))
    opts = ["checkpoint.every=4", "checkpoint.keep=20", "train.global_batch=12", "parallel.pp=2", "elastic.replan=true"]
    proc = start(run, *opts, nproc="3:4", steps=40, timeout_s=30)
    with reaped(proc):
        wait_for_step(proc, run, 9, timeout=300)
        agents = [p for p in workers(proc.pid) if p not in {d for a in workers(proc.pid) for d in descendants(a)}]
        killed = time.time()
        for pid in [*descendants(agents[-1]), agents[-1]]:
            os.kill(pid, signal.SIGKILL)
        while resumed_on(run, 3) is None and proc.poll() is None and time.time() < killed + 300:
            time.sleep(0.1)
        continued_s = time.time() - killed
        out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    event = resumed_on(run, 3)
    assert event is not None and event["saved_world_size"] == 4 and "pp=" not in event["plan"], event
    assert "4 -> 3 processes, re-planned as" in err, err[-2000:]
    step = event["step"]
    by_hand = tmp_path / "by-hand"  # the plan the job ran on 3 (its config.yaml, rewritten at that start), from its checkpoint
    cfg = load_config(str(run / "config.yaml"), [f"run.dir={by_hand}", "elastic.replan=false"])
    assert cfg.parallel.pp == 1 and not cfg.parallel.dims_problems(3)
    reference = run_ranks(3, train_body, cfg.model_dump(mode="json"), str(run / "checkpoints" / event["from"]), timeout=600)[0]["losses"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ours = {r["step"]: r["loss"] for r in rows if "loss" in r and r["step"] > step}
    assert len(reference) == 40 - step, (len(reference), step)
    for i, loss in enumerate(reference):
        assert ours[step + 1 + i] == pytest.approx(loss, rel=1e-5), (step + 1 + i, ours[step + 1 + i], loss)
    print(f"killed -> resumed on 3: {continued_s:.1f} s (resume event {event['time'] - killed:.1f} s, loading {event['load_s']:.1f} s)")
    assert continued_s < 60, f"the job trained on 3 processes only {continued_s:.0f} s after the kill (a loaded machine is slower)"
