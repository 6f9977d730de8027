"""The disk tier's scratch directory: claimed by one run, never silently reused, removed at the end.

The files under it are working copies of the model states, not a checkpoint (checkpoints are DCP, elsewhere):
a run that stops mid-step leaves them inconsistent, and nothing ever reads them back. A marker file names the
run that owns the directory (run directory, host, process id, start time), so that:

- a directory another live process holds is refused;
- a stale one (its process is gone) left by *this* run directory (a killed attempt being resumed) is emptied and
  reported, since its contents are of no use; one left by another run is refused, naming that run;
- a non-empty directory without a marker is refused (it is not behemoth's scratch);
- an unwritable one, or one on a disk without the space the plan needs, is refused before launch.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

from behemoth.comm import broadcast_object
from behemoth.errors import BehemothError
from behemoth.topology import Runtime

MARKER = "behemoth-offload.json"


def default_scratch(offload_dir: str | None, run_dir: str | None) -> Path:
    """`offload.dir`, or `<run.dir>/offload-scratch` (`OffloadConfig.scratch_dir`)."""
    from behemoth.config import OffloadConfig

    return OffloadConfig(dir=offload_dir).scratch_dir(run_dir)


def existing_ancestor(path: Path) -> Path:
    """The nearest folder on `path` that exists (where free space and permissions can be checked)."""
    p = path.resolve()
    while not p.exists():
        p = p.parent
    return p


def writable(folder: Path) -> bool:
    """Whether a file can be created in `folder` (tried, not inferred from permission bits)."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".behemoth-probe-")
    except OSError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


def read_marker(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def scratch_state(path: Path, run_dir: str | None) -> tuple[str, str]:
    """("free" | "stale-own" | "refused", why) for using `path` as this run's scratch."""
    if path.exists() and not path.is_dir():
        return "refused", f"offload.dir={path} is a file, not a directory; choose a directory"
    if not path.exists() or not any(path.iterdir()):
        here = existing_ancestor(path)
        if not writable(here):
            return "refused", f"offload.dir={path} cannot be written ({here} is not a writable directory); choose a writable directory"
        return "free", ""
    marker = read_marker(path)
    if marker is None:
        return "refused", f"offload.dir={path} holds files but no {MARKER}: it is not behemoth scratch; choose an empty or new directory"
    owner = f"run {marker.get('run_dir')} (pid {marker.get('pid')} on {marker.get('host')}, started {marker.get('started')})"
    live = marker.get("host") != socket.gethostname() or process_alive(int(marker.get("pid", 0)))
    if live:
        return "refused", f"offload.dir={path} is in use by {owner}; choose another offload.dir"
    if run_dir is not None and marker.get("run_dir") == str(Path(run_dir).resolve()):
        return "stale-own", f"offload.dir={path}: removed the stale scratch of an earlier attempt of this run ({owner})"
    return "refused", (f"offload.dir={path} holds the stale scratch of another {owner}; remove it (rm -r {path}) or choose another offload.dir")


def claim(path: Path, run_dir: str | None, *, keep: str | None = None) -> str | None:
    """Make `path` this run's empty scratch directory; a message when a stale one of this run was emptied. `keep`: a file
    (relative to `path`) whose presence in a stale scratch of this run keeps it as it is (a journaled run resumed)."""
    state, why = scratch_state(path, run_dir)
    if state == "refused":
        raise BehemothError(why)
    if state == "stale-own" and keep is not None and (path / keep).is_file():
        why = f"offload.dir={path}: reopened the journaled scratch of an earlier attempt of this run"
    elif state == "stale-own":
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    marker = {
        "run_dir": str(Path(run_dir).resolve()) if run_dir else None,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (path / MARKER).write_text(json.dumps(marker))
    return why or None


def release(path: Path) -> None:
    """Remove the scratch directory (the end of a run, or of a failed one: its contents are never reused)."""
    shutil.rmtree(path, ignore_errors=True)


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(existing_ancestor(path)).free


def claim_for_run(root: Path, run_dir: str | None, rt: Runtime, *, uses_disk: bool, keep: str | None = None) -> Path:
    """Rank 0 claims `root` for the run (refusing another run's, emptying a stale one of this run unless it holds `keep`);
    every rank learns how it went, so all refuse together."""

    def attempt() -> str | None:
        if not uses_disk:
            return None
        try:
            note = claim(root, run_dir, keep=keep)
        except BehemothError as err:
            return f"error: {err}"
        if note:
            print(f"behemoth: {note}", flush=True)
        return None

    error = broadcast_object(attempt, rt.world_group, rt.rank == 0) if rt.world_size > 1 else attempt()
    if error:
        raise BehemothError(error.removeprefix("error: "))
    return root
