"""Offload under a pipeline: each stage streams its own units in its schedule's order (offload/stage_stream.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.common import assert_close_runs
from tests.dist import run_ranks
from tests.test_composition import BASE, CORPUS, reference_config, tiny_config, train_plans


def pp_config(run_dir: Path, schedule: str, tier: str, microbatches: int, *extra: str) -> dict[str, Any]:
    options = ["parallel.pp=2", f"parallel.schedule={schedule}", f"parallel.microbatches={microbatches}"]
    return tiny_config(run_dir, f"data.path={CORPUS}", *BASE, *options, f"offload.params={tier}", f"offload.optimizer={tier}", *extra)


@pytest.mark.parametrize("schedule,tier,m", [("gpipe", "disk", 4), ("1f1b", "host", 4)])
def test_debug(tmp_path, schedule, tier, m):
    ref = run_ranks(1, train_plans, [reference_config(False, tmp_path / "ref")], timeout=120)[0][0]
    got = run_ranks(2, train_plans, [pp_config(tmp_path / "pp", schedule, tier, m)], timeout=160)[0][0]
    print(ref["losses"], got["losses"])
    assert_close_runs(ref, got)
