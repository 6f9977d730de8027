"""Start N local workers through torch's elastic launcher (the API torchrun is built on)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import uuid
from typing import Any, Callable

from behemoth.errors import ERROR_PREFIX, BehemothError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_worker(nproc: int) -> int:
    return max(1, (os.cpu_count() or 1) // nproc)


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def launch(nproc: int, entrypoint: Callable[..., Any], *args: Any, timeout_s: float = 300.0) -> dict[int, Any]:
    """Run `entrypoint(*args)` in `nproc` local processes; if one fails, the rest are stopped.

    Returns each local rank's return value. A worker that raises BehemothError leaves its one-line message in the failure record; it is
    raised here again as a BehemothError, so the user sees the line, not N tracebacks.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_worker(nproc)))
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    quiet_launcher_logs()
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
        rdzv_configs={"timeout": int(timeout_s)}, max_restarts=0, monitor_interval=0.2,
        start_method="spawn", shutdown_timeout=5,
    )
    try:
        return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as err:
        raise BehemothError(describe_failure(err)) from None


def describe_failure(err: Any) -> str:
    """One line for a failed launch: the first failing rank and what it said."""
    rank, failure = min(err.failures.items())
    message = failure.message if isinstance(failure.message, str) else str(failure.message)
    if isinstance(failure.message, dict):
        message = failure.message.get("message", message)
    line = next((l for l in message.splitlines() if l.startswith(ERROR_PREFIX)), None)
    if line is None:
        lines = [l.strip() for l in message.strip().splitlines() if l.strip() and "To enable traceback" not in l]
        if failure.exitcode is not None and failure.exitcode < 0:
            line = f"killed by signal {signal.Signals(-failure.exitcode).name}"
        elif lines and "Error" in lines[-1]:
            line = lines[-1].split("BehemothError: ")[-1]
        else:
            line = f"exited with code {failure.exitcode}"
    return f"worker rank {rank} failed: {line.removeprefix(ERROR_PREFIX)}"


def quiet_launcher_logs() -> None:
    """The elastic agent logs every failure at length; behemoth reports it in one line instead."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
