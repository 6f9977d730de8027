"""Background I/O: a few threads that read, step and write units while the main thread computes.

Jobs of one unit run in the order they were submitted (each waits for the unit's previous job), so a
read never overtakes the write-back before it; jobs of different units run in parallel. The number of
jobs not yet finished is bounded (`max_in_flight`): each holds buffers, so submitting more first waits for
the oldest. Time the main thread spends waiting for jobs is counted (`wait_s`): it is the I/O that compute
did not hide. A job's exception is raised where its result is waited for, at the latest by `drain`.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from typing import Any


class IOPool:
    """Per-unit ordered background jobs on `threads` threads, at most `max_in_flight` unfinished."""

    def __init__(self, threads: int, max_in_flight: int) -> None:
        if threads < 1 or max_in_flight < 1:
            raise ValueError(f"an I/O pool needs >= 1 thread and >= 1 job in flight, got {threads} and {max_in_flight}")
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="behemoth-offload-io")
        self.max_in_flight = max_in_flight
        self.last: dict[int, Future] = {}
        self.unfinished: deque[Future] = deque()
        self.wait_s = 0.0
        self.job_context: Callable[[], AbstractContextManager] | None = None  # what each job runs in (a memory meter's)

    def submit(self, unit: int, job: Callable[..., Any], *args: Any) -> Future:
        """Run `job(*args)` after every job submitted earlier for `unit`."""
        self._forget_finished()
        while len(self.unfinished) >= self.max_in_flight:
            self.wait(self.unfinished[0])
        before, done = self.last.get(unit), Future()
        future = self.pool.submit(_after, before, done, job, args, self.job_context)
        self.last[unit] = done  # the order of a unit's jobs needs their end, not their results (which may be large)
        self.unfinished.append(future)
        return future

    def wait(self, future: Future) -> Any:
        """The job's result (re-raising its error), counting the time the caller waited."""
        t0 = time.perf_counter()
        try:
            return future.result()
        finally:
            self.wait_s += time.perf_counter() - t0
            self._forget_finished()

    def _forget_finished(self) -> None:
        failed = next((f for f in self.unfinished if f.done() and f.exception() is not None), None)
        self.unfinished = deque(f for f in self.unfinished if not f.done())
        if failed is not None:
            raise failed.exception()

    def drain(self) -> None:
        """Wait for every job; raise the first error."""
        while self.unfinished:
            self.wait(self.unfinished[0])
        self.last = {u: f for u, f in self.last.items() if not f.done()}

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.pool.shutdown(wait=True)


def _after(before: Future | None, done: Future, job: Callable[..., Any], args: tuple, context: Callable[[], AbstractContextManager] | None) -> Any:
    try:
        if before is not None:
            before.result()  # an earlier job of this unit failed: so does this one
        with context() if context is not None else contextlib.nullcontext():
            result = job(*args)
    except BaseException as err:
        done.set_exception(err)
        raise
    done.set_result(None)
    return result
