"""`behemoth bench`: runs benchmark scripts one by one, gathers their ratio rows into one table and a chart per
family, and lists what could not run (a script that fails, or runs past its time) instead of stopping."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from behemoth.cli.bench import benchmark_scripts, draw_charts, markdown, run_script

ROWS = [
    {"family": "toy", "case": "one", "peer": "plain", "metric": "tokens/s", "behemoth": 12.0, "peer_value": 10.0, "ratio": 1.2},
    {"family": "toy", "peer": "missing peer", "error": "ModuleNotFoundError: No module named 'peer'"},
]


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "bench_toy.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_rows_of_a_script_are_gathered(tmp_path):
    path = script(
        tmp_path,
        f"""
        import json, sys
        quick = "--quick" in sys.argv
        rows = {json.dumps(ROWS)}
        rows[0]["case"] = "quick" if quick else "full"
        json.dump(rows, open(sys.argv[sys.argv.index("--json") + 1], "w"))
        print("ran")
        """,
    )
    got = run_script(path, True, 60, tmp_path / "toy.log")
    assert got[0]["case"] == "quick" and got[1]["error"].startswith("ModuleNotFoundError")
    assert (tmp_path / "toy.log").read_text().strip() == "ran"


def test_a_failing_or_hanging_script_is_reported_not_fatal(tmp_path):
    failing = script(tmp_path, "raise SystemExit('the peer would not start')\n")
    [row] = run_script(failing, False, 60, tmp_path / "f.log")
    assert row["family"] == "toy" and "exited with 1" in row["error"] and "the peer would not start" in row["error"]
    hanging = script(tmp_path, "import time\ntime.sleep(30)\n")
    [row] = run_script(hanging, False, 1, tmp_path / "h.log")
    assert row["error"] == "ran past 1 s"


def test_table_and_charts(tmp_path):
    text = markdown(ROWS, quick=False)
    assert "| toy | one | plain | tokens/s | 12 | 10 | 1.20 |" in text
    assert "Could not run:\n\n- toy: missing peer: ModuleNotFoundError" in text
    [chart] = draw_charts(ROWS, tmp_path)
    assert chart.name == "toy.png" and chart.stat().st_size > 1000


def test_every_benchmark_of_the_checkout_is_found():
    names = {p.stem for p in benchmark_scripts(None)}
    assert {"bench_dp", "bench_zero", "bench_tp", "bench_pipeline"} <= names and "ratios" not in names and "peers" not in names
