"""`behemoth sweep SWEEP.yaml`: many training runs of one base config, compared on validation loss (docs/sweep.md)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from behemoth.errors import ERROR_PREFIX, BehemothError, exit_code

if TYPE_CHECKING:
    from behemoth.sweep.executors import Executor
    from behemoth.sweep.setup import SweepSetup


def sweep_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="behemoth sweep",
        description="Run the trials of a sweep file (a base config and grid/list/random values over any config keys), each a normal "
        "behemoth run in its own directory under the sweep directory, optionally pruned by successive halving; then a leaderboard.",
        epilog="examples:\n  behemoth sweep examples/sweep.yaml --nproc 1\n"
        "  behemoth sweep examples/sweep.yaml --resume   # continue a killed sweep\n"
        "  behemoth sweep examples/sweep.yaml train.steps=40   # an option set on the base of every trial",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("file", metavar="SWEEP.yaml", help="the sweep file (docs/sweep.md)")
    p.add_argument("--nproc", type=int, metavar="N", help="processes per trial (default: sweep.nproc, else 1)")
    p.add_argument("--resume", action="store_true", help="continue the sweep in sweep.dir: finished trials kept, the others resumed")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config options applied to the base of every trial")
    return p


def sweep_main(argv: list[str]) -> int:
    args = sweep_parser().parse_args(argv)
    return exit_code(run_sweep, args)


def run_sweep(args: argparse.Namespace) -> int:
    from behemoth.sweep.runner import SweepRunner
    from behemoth.sweep.setup import prepare

    setup = prepare(Path(args.file), args.overrides, args.nproc, resume=args.resume)
    with open(setup.dir / "sweep.log", "a") as log:

        def say(line: str) -> None:  # the progress lines, also kept in the sweep directory
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()

        try:
            runner = SweepRunner(setup, say=say)
            rows = runner.run(launch(setup, args.resume))
        except KeyboardInterrupt:
            say(f"sweep: interrupted; continue with: behemoth sweep {args.file} --resume")
            return 130
    return 0 if all(not r["status"].startswith("failed") for r in rows) else 1


def launch(setup: SweepSetup, resume: bool) -> Executor:
    """The sweep's executor; a new sweep refused here (hydra's checks of every trial) leaves no sweep behind to resume,
    so the same command runs it once the sweep file is fixed."""
    from behemoth.sweep.runner import make_executor

    try:
        return make_executor(setup, train_segment)
    except BehemothError:
        if not resume:
            (setup.dir / "trials.json").unlink(missing_ok=True)
        raise


def train_segment(job: dict[str, Any]) -> dict[str, Any]:
    """One segment of a trial in this process: `behemoth train` to step job['stop_at'], resumed from the trial's checkpoint
    when it has one; its output goes to the trial's train.log, its error line (if any) into the outcome."""
    from behemoth.cli import main
    from behemoth.sweep.runner import checkpoint_step, val_loss_at

    t0, folder, stop_at = time.time(), Path(job["dir"]), job["stop_at"]
    start = checkpoint_step(folder)
    if start >= stop_at and val_loss_at(folder, stop_at) is not None:  # the sweep was killed after this segment ended
        return {"rc": 0, "error": None, "wall_s": 0.0}
    where = ["--resume", str(folder)] if start else ["--config", job["config"]]
    argv = ["train", "--nproc", str(job["nproc"]), *where, f"train.stop_at={stop_at}"]
    log = folder / "train.log"
    with to_log(log) as offset:
        try:
            rc = main(argv)
        except BaseException:  # noqa: BLE001 - a trial's crash is its outcome, never the sweep's (DCP's errors are BaseExceptions)
            traceback.print_exc()
            rc = 1
    return {"rc": rc, "error": None if rc == 0 else error_line(log, offset), "wall_s": time.time() - t0}


@contextlib.contextmanager
def to_log(path: Path) -> Iterator[int]:
    """This process's stdout and stderr (file descriptors: launched workers inherit them) appended to `path`; yields where
    this part of the log starts."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        offset = f.tell()
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield offset
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def error_line(log: Path, offset: int) -> str:
    """The line that says why a segment failed: behemoth's error line, else the last line it wrote (a traceback's last)."""
    with open(log, "rb") as f:
        f.seek(offset)
        lines = [line.strip() for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith(ERROR_PREFIX)]
    return (ours[-1] if ours else lines[-1] if lines else "exited without a message")[:300]
