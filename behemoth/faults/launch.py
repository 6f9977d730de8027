"""Start N local workers through torch's elastic agent (the API torchrun is built on); see `behemoth.faults.elastic`."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

from behemoth.faults.elastic import ElasticPolicy, describe_failures, launch_local, launch_nodes, quiet_launcher_logs

__all__ = ["ElasticPolicy", "describe_failures", "free_port", "launch", "launched_by_torchrun", "quiet_launcher_logs", "threads_per_worker"]


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (a rendezvous store's, a test server's)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_worker(nproc: int) -> int:
    return max(1, (os.cpu_count() or 1) // nproc)


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def launch(
    nproc: int | tuple[int, int], entrypoint: Callable[..., Any], *args: Any, timeout_s: float = 300.0, max_restarts: int = 0
) -> dict[int, Any]:
    """Run `entrypoint(*args)` in `nproc` local processes (or, for (MIN, MAX), MAX single-process elastic nodes that can
    shrink to MIN); if one fails, the rest are stopped, and started again up to `max_restarts` times.

    Returns each rank's return value (rank 0's at least). A worker that raises BehemothError leaves its one-line
    message in the failure record; it is raised here again as a BehemothError, so the user sees the line, not N tracebacks.
    """
    policy = ElasticPolicy(max_restarts=max_restarts, join_timeout_s=timeout_s)
    if isinstance(nproc, tuple):
        return launch_nodes(nproc, entrypoint, args, policy)
    return launch_local(nproc, entrypoint, args, policy)
