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
    assert re.search(r"rank 1 never arrived: it waits in all_reduce #2 on group right \(ranks 1,2\), where rank 2 never arrived "
                     r"\(its last op there: #1; no heartbeat for \d+ s: stopped, hung or dead\)", line), line
    assert f"rings in {tmp_path / 'hang'}" in line
    assert results[1] == "ok" and results[2] == "ok"  # rank 2, woken, completed the op rank 1 waited in
    rings = {p.name: json.loads(p.read_text()) for p in (tmp_path / "hang").glob("rank_*.json")}
    assert set(rings) == {"rank_0.json", "rank_1.json", "rank_2.json"}
    ops = [(r["op"], r["group"], r["seq"], r["end"] is None) for r in rings["rank_0.json"]["ring"]]
    assert ops[-2:] == [("all_reduce", "left", 1, False), ("all_reduce", "left", 2, True)], ops
