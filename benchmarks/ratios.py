"""The one format every benchmark script reports in, so `behemoth bench` can gather them into one table.

A script given `--json FILE` writes a list of rows there: a ratio of behemoth to a peer on one metric, or a
peer that could not run and why. A ratio above 1.0 always means behemoth did better (faster, or less
memory or CPU). `--quick` shrinks a script to a smoke run of a minute or two.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_report_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a short run: fewer steps, rounds and cases (minutes)")
    parser.add_argument("--json", metavar="FILE", help="also write the ratio rows to FILE (for `behemoth bench`)")


def command_line(script: str, argv: list[str] | None) -> str:
    """How the script was run, as a user would type it (`--json FILE`, `behemoth bench`'s plumbing, left out)."""
    args = list(argv if argv is not None else sys.argv[1:])
    if "--json" in args:
        i = args.index("--json")
        del args[i : i + 2]
    return " ".join([f"python benchmarks/{script}", *args])


def ratio(family: str, case: str, peer: str, metric: str, ours: float, theirs: float, *, higher_is_better: bool = True) -> dict[str, Any]:
    """One comparison: behemoth's value, the peer's, and their ratio oriented so that above 1.0 is behemoth's win."""
    value = ours / theirs if higher_is_better else theirs / ours
    return {"family": family, "case": case, "peer": peer, "metric": metric, "behemoth": ours, "peer_value": theirs, "ratio": value}


def failure(family: str, peer: str, reason: str) -> dict[str, Any]:
    """A peer that did not install or run here, with the reason (its error's last line)."""
    lines = [line for line in str(reason).strip().splitlines() if line.strip()]
    return {"family": family, "peer": peer, "error": (lines[-1] if lines else "failed")[:300]}


def write_rows(path: str | None, rows: list[dict[str, Any]]) -> None:
    if path:
        Path(path).write_text(json.dumps(rows, indent=1))


def best_of_rounds(
    systems: list[str], rounds: int, run: Callable[[str], dict[str, Any]], label: Callable[[dict[str, Any]], str], failed: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """Each system run `rounds` times in turn (every other round in reverse order, so no system always goes first).
    `run(name)` gives a row with `tokens_per_s` and `cpu_s`; kept per system: its fastest round, with the least CPU time
    per step over its rounds. A system whose run fails (a peer that does not install or run here: AssertionError from
    run_ranks) is recorded in `failed`, reported, and not run again."""
    best: dict[str, dict[str, Any]] = {}
    for r in range(rounds):
        for name in systems if r % 2 == 0 else systems[::-1]:
            if name in failed:
                continue
            try:
                row = run(name)
            except AssertionError as err:
                failed[name] = str(err)
                print(f"{name} failed: {str(err).strip().splitlines()[-1][:300]}", flush=True)
                continue
            print(f"round {r + 1}: {name:<23} {label(row)}", flush=True)
            cpu = min(row["cpu_s"], best[name]["cpu_s"]) if name in best else row["cpu_s"]
            if name not in best or row["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = row
            best[name]["cpu_s"] = cpu
    return {n: best[n] for n in systems if n in best}
