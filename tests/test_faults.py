"""Self-healing and hang diagnosis, end to end through `behemoth train` (and torchrun): a killed worker restarts and the
run ends with the uninterrupted final loss, bit for bit; a local run listens on the loopback only and leaves nothing in
the temporary folder; a stopped rank is named, with the operation, within run.timeout_s + 10 s; a run that loses a node
continues on fewer processes.

The many-trial chaos run is `python -m tests.chaos --trials 20` (and the slow test below); the default suite runs one.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from behemoth.config import load_config
from behemoth.faults.launch import free_port
from tests.chaos import TINY, descendants, is_loopback, listening_addresses, reaped, start, training_rows, wait_for_step, workers
from tests.chaos import main as chaos_main
from tests.common import train_body
from tests.dist import run_ranks


def test_a_killed_worker_restarts_and_the_run_ends_as_if_uninterrupted(tmp_path):
    """One chaos trial: SIGKILL a random worker at a random step; the run restarts its workers, resumes from the newest
    intact checkpoint and ends with the uninterrupted run's final loss (bit for bit). While it runs, every listening
    socket of the job is on the loopback; afterwards its temporary folder is empty."""
    cfg = load_config(None, ["train.steps=40", "checkpoint.every=4", "run.timeout_s=30", f"run.dir={tmp_path / 'reference'}", *TINY])
    reference = run_ranks(2, train_body, cfg.model_dump(mode="json"))[0]["losses"][-1]  # the same run as `behemoth train`, in-process
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    os.environ["TMPDIR"], saved = str(private_tmp), os.environ.get("TMPDIR")
    try:
        proc = start(tmp_path / "run", steps=40)
    finally:
        os.environ.pop("TMPDIR") if saved is None else os.environ.update(TMPDIR=saved)
    with reaped(proc):
        step = random.randrange(3, 12)  # well before the end (40): the steps are fast, the kill lands a little later
        wait_for_step(proc, tmp_path / "run", step)
        addresses = listening_addresses([proc.pid, *descendants(proc.pid)])
        victim = random.choice(workers(proc.pid))
        victim_cmdline = Path(f"/proc/{victim}/cmdline").read_bytes().replace(b"\0", b" ")[:300]
        os.kill(victim, signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    if "restarting the workers (restart 1 of 3)" not in err:  # the whole log, shown under "Captured stderr" if it fails
        print(f"killed pid {victim} at step {step}: {victim_cmdline!r}\n{err}", file=sys.stderr)
    assert proc.returncode == 0, err[-3000:]
    assert "restarting the workers (restart 1 of 3)" in err and "killed by signal SIGKILL" in err, (
        step,
        training_rows(tmp_path / "run")[-1],
        err[-3000:],
    )
    assert training_rows(tmp_path / "run")[-1]["loss"] == reference, f"killed at step {step}"
    assert addresses and all(is_loopback(a) for a in addresses), addresses
    left = [p.name for p in private_tmp.iterdir() if not p.name.startswith("torchinductor_")]  # torch's compile cache, reused
    assert left == [], left  # no torchelastic_* folder, no error-file pickles, no launch folder


def hang_ranks(run_dir: Path) -> dict[int, int]:
    """pid -> rank, from the rings a hang wrote (each holds the pid of the rank it describes)."""
    out = {}
    for path in (run_dir / "hang").glob("rank_*.json"):
        snap = json.loads(path.read_text())
        out[snap["pid"]] = snap["rank"]
    return out


LAYOUTS = {"dp": [], "tp": ["parallel.tp=2"], "pp": ["parallel.pp=2", "parallel.microbatches=2"]}


@pytest.mark.parametrize("layout", ["dp", pytest.param("tp", marks=pytest.mark.slow), pytest.param("pp", marks=pytest.mark.slow)])
def test_a_stopped_rank_is_named_within_the_timeout(tmp_path, layout):
    """SIGSTOP a random rank: the job ends within run.timeout_s + 10 s with one line naming the stopped rank and the
    operation everyone waited in, and the rings are in the run directory."""
    timeout, run_dir = 10, tmp_path / "run"
    proc = start(run_dir, *LAYOUTS[layout], "checkpoint.every=0", restarts=0, steps=100000, timeout_s=timeout)
    with reaped(proc):
        wait_for_step(proc, run_dir, 3)
        victim = random.choice(workers(proc.pid))
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, err = proc.communicate(timeout=timeout + 60)
        took = time.monotonic() - stopped_at
    assert proc.returncode == 2, err[-3000:]
    line = [l for l in err.splitlines() if l.startswith("behemoth: error: worker rank")][-1]
    assert took <= timeout + 10, (took, line)
    stopped = hang_ranks(run_dir)[victim]
    assert re.search(rf"rank {stopped} (never arrived|arrived but stopped inside it) \(its last op there: #\d+; no heartbeat for", line), line
    assert re.search(r"(all_reduce|reduce_scatter|all_gather|recv|send|barrier|broadcast_object|all_gather_object) #\d+ .*on group \w+", line), line
    assert f"rings in {run_dir / 'hang'}" in line


def stop_self_or_fail(folder: str) -> None:
    """A two-worker entry point: rank 0 stops itself (SIGSTOP) and, once woken, fails with a line about its own stop;
    rank 1 waits until rank 0 is stopped and fails with the line that names it."""
    from behemoth.faults.elastic import process_state
    from behemoth.flight.recorder import SELF_PAUSED

    marker = Path(folder) / "rank0.pid"
    if int(os.environ["RANK"]) == 0:
        marker.with_suffix(".tmp").write_text(str(os.getpid()))
        marker.with_suffix(".tmp").replace(marker)  # whole or absent: rank 1 polls it (it once read an empty file)
        os.kill(os.getpid(), signal.SIGSTOP)
        raise RuntimeError(f"rank 0: all_reduce #3 waited 10.0 s: rank 0 {SELF_PAUSED} for 9 s of the wait")
    deadline = time.monotonic() + 30
    while not (marker.exists() and process_state(int(marker.read_text())) == "T") and time.monotonic() < deadline:
        time.sleep(0.05)
    raise RuntimeError("rank 1: all_reduce #3 waited 10.0 s: rank 0 never arrived")


def test_the_cause_is_named_even_when_the_woken_rank_exits_first(tmp_path, monkeypatch):
    """A rank woken because its peer died can exit before the launcher looks (it was past its timeout): the one line
    still names the peer that failed first, not the woken rank's line about its own stop. The launcher is held for
    1 s after the wake so that both workers have exited when it looks."""
    from behemoth.faults import elastic

    wake = elastic.wake_if_peer_died

    def wake_then_lag(pids: dict[int, int]) -> dict[int, int]:
        dead = wake(pids)
        if dead:
            time.sleep(1.0)
        return dead

    monkeypatch.setattr(elastic, "wake_if_peer_died", wake_then_lag)
    with pytest.raises(elastic.BehemothError) as failed:
        elastic.launch_local(2, stop_self_or_fail, (str(tmp_path),), elastic.ElasticPolicy(grace_s=3.0))
    assert str(failed.value).startswith("worker rank 1 failed: "), str(failed.value)
    assert "rank 0 never arrived" in str(failed.value), str(failed.value)


@pytest.mark.slow
def test_chaos_twenty_trials():
    assert chaos_main(["--trials", "20"]) == 0


@pytest.mark.slow
def test_torchrun_two_nodes_survive_losing_one(tmp_path):
    """Two torchrun 'nodes' of one process each on this machine (c10d rendezvous, --nnodes 1:2): SIGKILL one node (its
    agent and its worker); the other restarts its worker, which resumes from the newest intact checkpoint on 1 process."""
    run_dir, port = tmp_path / "run", free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_GLOO_LAZY_INIT": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "lose-a-node",
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.2",
        "--rdzv-conf",
        "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3",
        "-m",
        "behemoth",
        "train",
        f"run.dir={run_dir}",
        "train.steps=200",
        "checkpoint.every=10",
        "run.timeout_s=20",
        *TINY,
    ]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)]
    time.sleep(2)  # the first node hosts the rendezvous store
    nodes.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True))
    with reaped(*nodes):
        wait_for_step(nodes[0], run_dir, 30, timeout=300)
        for pid in [*descendants(nodes[1].pid), nodes[1].pid]:  # torchrun starts its workers in sessions of their own
            os.kill(pid, signal.SIGKILL)
        out, err = nodes[0].communicate(timeout=400)
    assert nodes[0].returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in rows if r.get("event") == "resume"]
    assert resumed and resumed[-1]["world_size"] == 1 and resumed[-1]["saved_world_size"] == 2, resumed
    assert [r["step"] for r in rows if "loss" in r][-1] == 200 and "behemoth: done" in out


def descendants_of_any(pids: list[int]) -> set[int]:
    return {d for pid in pids for d in descendants(pid)}


@pytest.mark.slow
def test_local_elastic_run_continues_on_fewer_processes(tmp_path):
    """`--nproc 1:2`: two single-process elastic nodes on this machine; SIGKILL one node's agent and worker, and the run
    continues on one process, resharding the checkpoint, to the end."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, "checkpoint.every=10", nproc="1:2", steps=200)
    with reaped(proc):
        wait_for_step(proc, run_dir, 30, timeout=300)
        agents = [p for p in workers(proc.pid) if p not in descendants_of_any(workers(proc.pid))]
        node = agents[-1]
        for pid in [*descendants(node), node]:
            os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in rows if r.get("event") == "resume"]
    assert resumed and resumed[-1]["world_size"] == 1 and resumed[-1]["saved_world_size"] == 2, resumed
    assert [r["step"] for r in rows if "loss" in r][-1] == 200
