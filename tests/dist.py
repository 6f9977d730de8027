"""The multi-process test helpers: `run_ranks(world, body, *args)` (see behemoth/faults/ranks.py), and
`wait_for_health` for a server started as its own process tree."""

from __future__ import annotations

import subprocess

from behemoth.faults.ranks import run_ranks

__all__ = ["run_ranks", "wait_for_health"]


def wait_for_health(proc: subprocess.Popen, url: str, seconds: float = 240) -> None:
    """Return once the server `proc` started answers `url`/health with 200; fail if it exits or `seconds` pass."""
    import time

    import httpx

    deadline = time.monotonic() + seconds
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, f"the server did not start: {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
