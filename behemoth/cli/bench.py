"""`behemoth bench`: every benchmark of the source checkout against every peer that runs here, one after another,
gathered into one markdown table of ratios and one bar chart per family.

Each `benchmarks/bench_*.py` runs behemoth and its peers in one process tree and writes its comparisons as ratio
rows (`benchmarks/ratios.py`: above 1.0 means behemoth did better). A peer that does not install or run is
listed with the reason; a script that fails as a whole is listed the same way. `--quick` runs each script's short
mode (minutes in all); the full mode is what benchmarks/README.md reports.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from behemoth.errors import BehemothError, exit_code

HELPERS = {"ratios.py", "peers.py"}  # modules the scripts share, not benchmarks


def bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="behemoth bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="each benchmark's short run (minutes in all)")
    p.add_argument("--only", metavar="NAMES", help="comma-separated benchmark names, e.g. dp,zero (default: every benchmarks/bench_*.py)")
    p.add_argument("--out", metavar="DIR", help="where bench.md and the charts go (default benchmarks/results/<time>)")
    p.add_argument("--timeout", type=float, metavar="S", help="longest a script may run (default 600 s quick, 7200 s full)")
    return p


def bench_main(argv: list[str] | None = None) -> int:
    return exit_code(run_bench, bench_parser().parse_args(argv))


def benchmark_scripts(only: str | None) -> list[Path]:
    """The checkout's benchmark scripts, by name (`bench_dp.py` is `dp`)."""
    folder = Path(__file__).resolve().parents[2] / "benchmarks"
    if not folder.is_dir():
        raise BehemothError(
            f"no benchmarks/ folder beside this behemoth ({folder})", "run behemoth bench from a source checkout installed with pip install -e ."
        )
    scripts = {p.stem.removeprefix("bench_"): p for p in sorted(folder.glob("bench_*.py")) if p.name not in HELPERS}
    names = only.split(",") if only else list(scripts)
    unknown = [n for n in names if n not in scripts]
    if unknown:
        raise BehemothError(f"--only names {', '.join(unknown)}, which have no benchmarks/bench_NAME.py", f"choose from {', '.join(scripts)}")
    return [scripts[n] for n in names]


def run_bench(args: argparse.Namespace) -> int:
    scripts = benchmark_scripts(args.only)
    out = Path(args.out or Path(scripts[0]).parent / "results" / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    timeout = args.timeout or (600.0 if args.quick else 7200.0)
    rows: list[dict[str, Any]] = []
    for i, script in enumerate(scripts, 1):
        print(f"behemoth bench: [{i}/{len(scripts)}] {script.name}{' --quick' if args.quick else ''} ...", flush=True)
        t0 = time.time()
        got = run_script(script, args.quick, timeout, out / f"{script.stem}.log")
        rows += got
        print(f"behemoth bench: [{i}/{len(scripts)}] {script.name}: {len(got)} rows in {time.time() - t0:.0f} s", flush=True)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    (out / "bench.md").write_text(markdown(rows, args.quick))
    charts = draw_charts(rows, out)
    print(f"behemoth bench: wrote {out / 'bench.md'} and {len(charts)} chart(s) in {out}")
    return 0


def run_script(script: Path, quick: bool, timeout: float, log: Path) -> list[dict[str, Any]]:
    """One benchmark in its own process; its rows, or one failure row naming what went wrong."""
    family = script.stem.removeprefix("bench_")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = Path(f.name)
    cmd = [sys.executable, str(script), "--json", str(result)] + (["--quick"] if quick else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    try:
        with open(log, "w") as sink:
            proc = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, timeout=timeout, env=env, cwd=script.parents[1])
        if proc.returncode != 0:
            return [{"family": family, "peer": "(the whole benchmark)", "error": f"exited with {proc.returncode}: {tail(log)}"}]
        rows: list[dict[str, Any]] = json.loads(result.read_text())
        return rows
    except subprocess.TimeoutExpired:
        return [{"family": family, "peer": "(the whole benchmark)", "error": f"ran past {timeout:.0f} s"}]
    except (OSError, ValueError) as err:
        return [{"family": family, "peer": "(the whole benchmark)", "error": f"wrote no rows ({err.__class__.__name__})"}]
    finally:
        result.unlink(missing_ok=True)


def tail(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def markdown(rows: list[dict[str, Any]], quick: bool) -> str:
    """One table of every ratio (above 1.0: behemoth better), then what could not run."""
    ok = [r for r in rows if "error" not in r]
    head = (
        f"# behemoth bench{' (quick)' if quick else ''}\n\nMeasured on this machine; each ratio is behemoth against the peer, "
        "oriented so that above 1.0 means behemoth did better (faster, or less memory or CPU time).\n\n"
    )
    lines = ["| family | case | peer | metric | behemoth | peer | ratio |", "|---|---|---|---|---:|---:|---:|"]
    lines += [
        f"| {r['family']} | {r['case']} | {r['peer']} | {r['metric']} | {r['behemoth']:.4g} | {r['peer_value']:.4g} | {r['ratio']:.2f} |" for r in ok
    ]
    failed = [f"- {r['family']}: {r['peer']}: {r['error']}" for r in rows if "error" in r]
    return head + "\n".join(lines) + ("\n\nCould not run:\n\n" + "\n".join(failed) if failed else "") + "\n"


def colour(ratio: float) -> str:
    """Green where behemoth is ahead, red where it trails, grey within ±5% (the run-to-run spread of this machine)."""
    return "tab:gray" if 0.95 <= ratio <= 1.05 else "tab:green" if ratio > 1 else "tab:red"


def draw_charts(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """A horizontal bar chart of the ratios of each family, with the line of parity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for family in dict.fromkeys(r["family"] for r in rows if "error" not in r):
        mine = [r for r in rows if r["family"] == family and "error" not in r]
        labels = [f"{r['case']} vs {r['peer']}: {r['metric']}" for r in mine]
        fig, ax = plt.subplots(figsize=(9, 0.35 * len(mine) + 1.2))
        ax.barh(range(len(mine)), [r["ratio"] for r in mine], color=[colour(r["ratio"]) for r in mine])
        ax.axvline(1.0, color="black", lw=1)
        ax.set_yticks(range(len(mine)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel("behemoth / peer (above 1: behemoth better; grey: within 5%)")
        ax.set_title(family)
        fig.tight_layout()
        path = out / f"{family.replace(' ', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


if __name__ == "__main__":
    raise SystemExit(bench_main())
