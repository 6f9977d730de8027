"""Multiplexing (DeepPool): a background job runs in the device time a burst plan's foreground leaves idle, at a
priority low enough that the foreground barely notices it.

On a CPU the background job is an ordinary process in its own session at OS scheduling priority `nice` 19, the
session's autogroup lowered too where Linux groups sessions, so the kernel runs it mostly when the foreground's ranks
are not runnable: waiting on a transfer, or outside their layer's group; it can be pinned to the cores of the ranks a
plan idles most. On a GPU the same split is a pair of CUDA streams: the foreground's kernels on the greatest stream
priority, the background's on the least, so the scheduler prefers the foreground's blocks.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

BACKGROUND_NICE = 19
AUTOGROUP = Path("/proc/self/autogroup")  # Linux's per-session scheduling group (sched_autogroup_enabled)


def idle_layers(widths: Sequence[int], world: int) -> list[int]:
    """Per rank, how many layers of the plan it sits out (rank r takes part in layer l when r < widths[l])."""
    return [sum(1 for w in widths if r >= w) for r in range(world)]


def idle_ranks(widths: Sequence[int], world: int) -> list[int]:
    """The ranks that sit out the most layers, most idle first (all of them when the plan idles none)."""
    idle = idle_layers(widths, world)
    most = max(idle)
    return [r for r in sorted(range(world), key=lambda r: -idle[r]) if idle[r] == most] if most else list(range(world))


@dataclass
class BackgroundJob:
    """A background process this job started (its own session, so stopping it stops its children and nothing else)."""

    process: subprocess.Popen[bytes]

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> int:
        """Ask it to stop (SIGTERM to its process group), then kill it after `timeout_s`; its exit code."""
        if self.running():
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                return self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.wait()


def lower_priority(nice: int = BACKGROUND_NICE, cpus: Sequence[int] | None = None) -> None:
    """Lower this process to `nice` (and its session's autogroup where Linux groups sessions: otherwise niceness only
    orders one session's processes), pinned to `cpus` where given. A job may call it itself once warmed up."""
    if nice > 0:
        os.nice(nice)
        if AUTOGROUP.exists():
            AUTOGROUP.write_text(str(nice))
    if cpus:
        os.sched_setaffinity(0, set(cpus))


def start_background(
    argv: Sequence[str], *, cpus: Sequence[int] | None = None, nice: int = BACKGROUND_NICE, env: dict[str, str] | None = None
) -> BackgroundJob:
    """Start `argv` (e.g. a `behemoth train` trial) at OS priority `nice`, pinned to `cpus` where given."""

    process = subprocess.Popen(list(argv), preexec_fn=lambda: lower_priority(nice, cpus), start_new_session=True, env=env, stdout=subprocess.DEVNULL)
    return BackgroundJob(process)


def stream_priorities() -> tuple[int, int] | None:
    """(foreground, background) CUDA stream priorities (the greatest and the least), or None without a GPU."""
    if not torch.cuda.is_available():
        return None
    least, greatest = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]  # a static method the stubs call an instance method
    return greatest, least


def priority_stream(foreground: bool) -> torch.cuda.Stream | None:
    """A CUDA stream at the foreground's (greatest) or the background's (least) priority; None without a GPU."""
    priorities = stream_priorities()
    if priorities is None:
        return None
    return torch.cuda.Stream(priority=priorities[0] if foreground else priorities[1])
