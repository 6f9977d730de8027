"""The flight recorder names who a hung wait waits for, following the chain: rank 0 waits on rank 1, which waits on
rank 2, which is stopped; rank 0's line says so, and every rank's ring is written to the run directory."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import time

from tests.dist import run_ranks


def _chain(run_dir: str) -> str:
    """Groups left = [0, 1] and right = [1, 2]; rank 2 stops itself; rank 1 waits for it in `right` (8 s timeout);
    rank 0 waits for rank 1 in `left` (3 s timeout) and reports, then wakes rank 2, which completes rank 1's op."""
    import torch
    import torch.distributed as dist

    from behemoth.comm import all_reduce
    from behemoth.errors import BehemothError
    from behemoth.flight import RECORDER

    rank, t = dist.get_rank(), torch.ones(1)
    left = dist.new_group([0, 1], group_desc="left", timeout=datetime.timedelta(seconds=3))
    right = dist.new_group([1, 2], group_desc="right", timeout=datetime.timedelta(seconds=8))
    RECORDER.arm(run_dir=run_dir, timeout_s=3)
    if rank in (0, 1):
        all_reduce(t, left)
    if rank in (1, 2):
        all_reduce(t, right)
    time.sleep(1.5)  # a heartbeat or two with these counters
    result = "ok"
    try:
        if rank == 2:
            os.kill(os.getpid(), signal.SIGSTOP)  # ... until rank 0 wakes it
            all_reduce(t, right)
        elif rank == 1:
            all_reduce(t, right)
        else:
            time.sleep(0.5)
            all_reduce(t, left)
    except BehemothError as err:
        result = str(err)
        os.kill(RECORDER.published(2)["pid"], signal.SIGCONT)
    RECORDER.disarm()
    return result


def test_a_hang_names_the_rank_at_the_end_of_the_chain(tmp_path):
    results = run_ranks(3, _chain, str(tmp_path), timeout=60)
    line = results[0]
    assert line.startswith("rank 0: all_reduce #2 on group left (ranks 0,1) waited "), line
    assert re.search(
        r"rank 1 never arrived: it waits in all_reduce #2 on group right \(ranks 1,2\), where rank 2 never arrived "
        r"\(its last op there: #1; no heartbeat for \d+ s: stopped, hung or dead\)",
        line,
    ), line
    assert f"rings in {tmp_path / 'hang'}" in line
    assert results[1] == "ok" and results[2] == "ok"  # rank 2, woken, completed the op rank 1 waited in
    rings = {p.name: json.loads(p.read_text()) for p in (tmp_path / "hang").glob("rank_*.json")}
    assert set(rings) == {"rank_0.json", "rank_1.json", "rank_2.json"}
    ops = [(r["op"], r["group"], r["seq"], r["end"] is None) for r in rings["rank_0.json"]["ring"]]
    assert ops[-2:] == [("all_reduce", "left", 1, False), ("all_reduce", "left", 2, True)], ops


# `diagnose` alone: a pure function of the peers' published snapshots (no processes)

NOW, STALE_S = 1000.0, 4.0
LEFT, RIGHT = "left:0,1", "right:1,2"


def _op(op: str, group: str, ranks: list[int], seq: int, start: float, *, peer: int | None = None, key: str | None = None):
    from behemoth.flight import OpRecord

    return OpRecord(op, group, ranks, key or f"{group}:{','.join(map(str, ranks))}", seq, start, peer)


def _snap(rank: int, age: float, counters: dict[str, int], waiting: list | None = None) -> dict:
    from dataclasses import asdict

    return {"rank": rank, "pid": 100 + rank, "host": "h", "t": NOW - age, "counters": counters, "ring": [asdict(r) for r in waiting or []]}


def test_diagnose_names_a_stopped_peer_and_one_that_stopped_inside_the_op():
    from behemoth.flight import diagnose

    rec = _op("all_reduce", "left", [0, 1], 2, NOW - 30)
    stopped = diagnose(rec, {1: _snap(1, 12.0, {LEFT: 1})}, me=0, now=NOW, stale_s=STALE_S)
    assert stopped == ["rank 1 never arrived (its last op there: #1; no heartbeat for 12 s: stopped, hung or dead)"]
    hung = diagnose(rec, {1: _snap(1, 9.0, {LEFT: 2})}, me=0, now=NOW, stale_s=STALE_S)
    assert hung == ["rank 1 arrived but stopped inside it (its last op there: #2; no heartbeat for 9 s: stopped, hung or dead)"]


def test_diagnose_follows_a_chain_of_waits_to_its_end():
    from behemoth.flight import diagnose, hang_line

    rec = _op("all_reduce", "left", [0, 1], 2, NOW - 3.2)
    waits_right = _op("all_reduce", "right", [1, 2], 2, NOW - 5)
    published = {1: _snap(1, 0.5, {LEFT: 1, RIGHT: 2}, [waits_right]), 2: _snap(2, 7.0, {RIGHT: 1})}
    culprits = diagnose(rec, published, me=0, now=NOW, stale_s=STALE_S)
    assert culprits == [
        "rank 1 never arrived: it waits in all_reduce #2 on group right (ranks 1,2), where rank 2 never "
        "arrived (its last op there: #1; no heartbeat for 7 s: stopped, hung or dead)"
    ]
    line = hang_line(rec, culprits, waited=3.2, limit_s=3, timed_out=True, err=None)
    assert line == "all_reduce #2 on group left (ranks 0,1) waited 3.2 s (run.timeout_s=3): " + culprits[0]
    served = hang_line(rec, culprits, waited=3.2, limit_s=3, limit_name="--step-timeout-s", timed_out=True, err=None)
    assert served.startswith("all_reduce #2 on group left (ranks 0,1) waited 3.2 s (--step-timeout-s=3): "), served
    # a chain that loops back (rank 2 waits for rank 1) stops at the rank already named
    loop = {1: published[1], 2: _snap(2, 0.5, {RIGHT: 1}, [_op("all_reduce", "right", [1, 2], 1, NOW - 4)])}
    assert diagnose(rec, loop, me=0, now=NOW, stale_s=STALE_S) == [
        "rank 1 never arrived: it waits in all_reduce #2 on group right (ranks 1,2), where rank 2 never arrived: it waits "
        "in all_reduce #1 on group right (ranks 1,2)"
    ]


def test_diagnose_names_a_peer_that_went_away_and_one_that_never_started():
    from behemoth.flight import diagnose, hang_line

    recv = _op("recv", "pp", [0, 1], 3, NOW - 0.4, peer=1, key="pp:0,1:1->0")
    gone = diagnose(recv, {1: _snap(1, 0.5, {"pp:0,1:1->0": 2})}, me=0, now=NOW, stale_s=STALE_S, timed_out=False)
    assert gone == ["rank 1 had not arrived (its last op there: #2; it failed or died, see its line)"]
    line = hang_line(
        recv,
        gone,
        waited=0.4,
        limit_s=300,
        timed_out=False,
        err=RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"),
    )
    assert line == f"recv #3 from rank 1 on group pp (ranks 0,1) failed after 0.4 s (Connection closed by peer): {gone[0]}"
    never = diagnose(_op("barrier", "world", [0, 1, 2], 1, NOW - 9), {1: None, 2: _snap(2, 0.1, {"world:0,1,2": 1})}, me=0, now=NOW, stale_s=STALE_S)
    assert never == ["rank 1 never published a heartbeat (it may not have started)"]


def test_diagnose_finds_nobody_when_every_rank_arrived():
    from behemoth.flight import diagnose, hang_line

    rec = _op("all_gather", "dp", [0, 1], 5, NOW - 6)
    assert diagnose(rec, {1: _snap(1, 0.2, {"dp:0,1": 5})}, me=0, now=NOW, stale_s=STALE_S) == []
    assert hang_line(rec, [], waited=6, limit_s=5, timed_out=True, err=None).endswith(
        ": every rank of the group had arrived; the transfer itself stalled"
    )


STOPPED_CHILD = """
import sys, time
from behemoth.flight.heartbeat import Heartbeat
beat = Heartbeat(0, timeout_s=5.0, snapshot=dict, on_beat=lambda: None)
beat.start(None)
since = time.time()
print("ready", flush=True)
sys.stdin.readline()  # the parent stops this process, wakes it and then writes a line
print(round(beat.not_running_since(since, time.time()), 1), flush=True)
"""


def test_a_rank_that_was_itself_stopped_knows_it_and_its_line_is_not_taken_as_the_cause():
    """SIGSTOP a process with a heartbeat for 6 s: once woken it measures that stretch (its peers' diagnosis is the
    one to believe, and the launcher's one line picks theirs)."""
    import subprocess
    import sys

    from behemoth.faults.elastic import describe_failures
    from behemoth.flight.recorder import SELF_PAUSED

    child = subprocess.Popen([sys.executable, "-c", STOPPED_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(6.0)
        os.kill(child.pid, signal.SIGCONT)
        out, _ = child.communicate("go\n", timeout=30)
    finally:
        child.kill()
    assert 4.5 <= float(out.strip()) <= 7.0, out

    class Failure:
        def __init__(self, message: str) -> None:
            self.exitcode, self.message = 1, {"message": message}

    woken = Failure(f"HangError: behemoth: error: rank 0: all_reduce #11 waited 10.1 s: rank 0 {SELF_PAUSED} for 12 s of the wait")
    named = Failure("HangError: behemoth: error: rank 1: all_reduce #11 waited 10.0 s: rank 0 arrived but stopped inside it")
    assert describe_failures({0: woken, 1: named}).startswith("worker rank 1 failed: rank 1: all_reduce #11")
