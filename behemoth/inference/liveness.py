"""The serving engine's watchdog: a step that never returns fails the engine, and a failed engine stops the server.

A tensor- or pipeline-parallel worker that dies closes its sockets, so the collective rank 0 waits in fails at once
(gloo) and the engine fails by itself; one that hangs (stopped, deadlocked, a device that no longer answers) leaves
rank 0's collective waiting until c10d's timeout (run.timeout_s, 300 s by default) while /health says ok. The
watchdog bounds that: a step (or an idle keepalive) of the engine that has run longer than `step_timeout_s` fails the
engine, naming the collective it waits in and, from the flight recorder's heartbeats, the rank that never arrived
(`behemoth.flight`). Every collective of serving goes through `behemoth.comm`, so each is in the recorder's ring.
Once the engine has failed, for whatever reason, `on_failed` runs after `exit_after_s` (the command line stops the
HTTP server then, and the process exits non-zero): /health and every request answer 503 meanwhile.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

from behemoth.errors import ERROR_PREFIX
from behemoth.flight import RECORDER
from behemoth.inference.serving import EngineLoop


def hung_reason(waited_s: float, step_timeout_s: float) -> str:
    """Why a step that has waited `waited_s` is declared hung: the oldest collective still waiting, and who it waits for."""
    line = f"an engine step has run for {waited_s:.0f} s, over the step timeout of {step_timeout_s:g} s (--step-timeout-s)"
    stuck = RECORDER.ring.stuck(time.time(), 0.0)
    if not stuck:
        return line
    try:
        diagnosis = RECORDER.failure(min(stuck, key=lambda r: r.start), None, step_timeout_s, "--step-timeout-s").diagnosis
    except Exception as err:  # a diagnosis that cannot read the peers' heartbeats still names the operation
        diagnosis = f"{min(stuck, key=lambda r: r.start).describe()} ({err.__class__.__name__})"
    return f"{line}: {diagnosis}"


class EngineWatchdog:
    """A thread that fails `engine` when one of its steps outlives `step_timeout_s` (None: steps are not timed), and
    calls `on_failed` once, `exit_after_s` after the engine failed (a failed step, a hung one, or a dead engine thread)."""

    def __init__(
        self,
        engine: EngineLoop,
        step_timeout_s: float | None,
        on_failed: Callable[[], None] | None = None,
        *,
        exit_after_s: float = 2.0,
        every_s: float = 0.2,
    ) -> None:
        self.engine, self.step_timeout_s, self.on_failed = engine, step_timeout_s, on_failed
        self.exit_after_s, self.every_s = exit_after_s, every_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="behemoth-engine-watchdog", daemon=True)

    def start(self) -> EngineWatchdog:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.done.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=5)

    def check(self) -> bool:
        """Fail the engine if its step in progress has run too long, or if its thread ended without saying why; True
        once the engine has failed."""
        engine = self.engine
        if engine.error is None:
            since = engine.busy_since
            limit = self.step_timeout_s
            if since is not None and limit is not None and time.monotonic() - since > limit:
                engine.fail(hung_reason(time.monotonic() - since, limit))
            elif engine.thread.ident is not None and not engine.thread.is_alive() and not engine.stopping:
                engine.fail("the engine thread ended")
        return engine.error is not None

    def _run(self) -> None:
        failed_at: float | None = None
        while not self.done.wait(self.every_s):
            if failed_at is None:
                if self.check():
                    failed_at = time.monotonic()
                    last = (self.engine.error or "").strip().splitlines()[-1:]
                    print(f"{ERROR_PREFIX}the serving engine failed: {''.join(last)}", file=sys.stderr, flush=True)
            elif time.monotonic() - failed_at >= self.exit_after_s:
                if self.on_failed is not None:
                    self.on_failed()
                return
