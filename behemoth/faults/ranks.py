"""Run a function on N local processes joined by gloo over a TCP store the caller hosts, with bounded waits.

    results = run_ranks(4, body, arg1, arg2)   # body(arg1, arg2) runs on ranks 0..3

For tests and benchmarks, which need return values and tracebacks in the calling process (training
jobs use `behemoth.faults.launch` instead). `body` must be a module-level function (it is sent to the
workers by reference). Each rank has `threads` intra-op threads, a default process group with a
short timeout, and returns a picklable value. A rank that raises fails the call with its
traceback; a rank still running at the deadline is killed and the call fails naming it, so a hung
collective can never hang a test suite.

The store is served by the calling process, which no test stops: a rank stopped with SIGSTOP (the fault tests do
that) cannot wedge it, as it could a file store whose lock it held when it stopped. Each rank also finds it through
MASTER_ADDR/MASTER_PORT, as under torchrun, so the flight recorder's heartbeats get a connection of their own.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# imported once by the fork server (transformers' model modules where it is installed: HF tests spawn many ranks)
PRELOAD = [
    "torch",
    "torch.distributed",
    "behemoth.train",
    "matplotlib.pyplot",
    "behemoth.models.hf",
    *(f"transformers.models.{m}.modeling_{m}" for m in ("llama", "gpt2", "mixtral", "mistral", "qwen2")),
]
COLLECTIVE_TIMEOUT_S = 60
_context = None


def context() -> mp.context.BaseContext:
    """A forkserver that imported torch once: each rank starts in milliseconds and safely."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _rank_main(rank: int, world: int, folder: str, port: int, threads: int, body: Callable[..., Any], args: tuple) -> None:
    os.environ.update(OMP_NUM_THREADS=str(threads), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    out = Path(folder) / f"rank{rank}.pkl"
    try:
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        result = ("ok", body(*args))
    except BaseException:  # report everything, including assertion failures, to the parent
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    out.write_bytes(pickle.dumps(result))


def run_ranks(world: int, body: Callable[..., Any], *args: Any, timeout: float = 180.0, threads: int = 1) -> list[Any]:
    """`body(*args)` on `world` ranks; the list of their return values, rank order."""
    import torch.distributed as dist

    ctx = context()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    with tempfile.TemporaryDirectory(prefix="behemoth-ranks-") as folder:
        procs = [ctx.Process(target=_rank_main, args=(r, world, folder, store.port, threads, body, args), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
        _join(procs, folder, timeout)
        results = []
        for r in range(world):
            path = Path(folder) / f"rank{r}.pkl"
            if not path.exists():
                raise AssertionError(f"rank {r} exited with code {procs[r].exitcode} and left no result")
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                raise AssertionError(f"rank {r} of {world} failed:\n{value}")
            results.append(value)
        return results


def _join(procs: list, folder: str, timeout: float) -> None:
    """Wait for every rank; once one has failed give the others a short grace, then kill them."""
    deadline = time.monotonic() + timeout
    failed_at = None
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        if failed_at is None and any(_failed(p, r, folder) for r, p in enumerate(procs)):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + 10):
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            for p in procs:
                p.kill()
            if failed_at is None:
                raise AssertionError(f"ranks {alive} still running after {timeout:.0f} s (a hung collective?)")
            return
        time.sleep(0.02)


def _failed(p, rank: int, folder: str) -> bool:
    path = Path(folder) / f"rank{rank}.pkl"
    if p.is_alive():
        return False
    return not path.exists() or pickle.loads(path.read_bytes())[0] == "error"
