"""Multiplexing: which ranks a burst plan idles, and a background job really runs at low priority."""

from __future__ import annotations

import os
import time
from pathlib import Path

from behemoth.parallel.burst.multiplex import AUTOGROUP, idle_layers, idle_ranks, start_background


def test_idle_ranks_of_a_plan():
    widths = (2, 4, 1, 3, 4)
    assert idle_layers(widths, 4) == [0, 1, 2, 3]
    assert idle_ranks(widths, 4) == [3]
    assert idle_ranks((4, 4), 4) == [0, 1, 2, 3]  # plain data parallelism idles no rank


def test_background_job_runs_niced_in_its_own_session(tmp_path: Path):
    """A shell, not Python: a job at nice 19 on a loaded machine may wait long for the CPU time an interpreter start needs."""
    out = tmp_path / "priority"
    probe = 'nice > "$0"; echo $$ $(cut -d" " -f6 /proc/$$/stat) >> "$0"; cat /proc/self/autogroup >> "$0" 2>/dev/null; true'
    job = start_background(["/bin/sh", "-c", probe, str(out)], nice=19)
    assert job.process.wait(60) == 0
    lines = out.read_text().splitlines()
    assert int(lines[0]) == min(19, os.nice(0) + 19)
    pid, session = lines[1].split()
    assert pid == session, "the background job leads its own session"
    if AUTOGROUP.exists():
        assert lines[2].split()[-1] == "19", lines[2]


def test_stopping_a_background_job():
    job = start_background(["sleep", "60"], nice=19)
    time.sleep(0.2)
    assert job.running()
    job.stop(timeout_s=10)
    assert not job.running()
