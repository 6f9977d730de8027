"""The serving engine: the scheduler stepping on its own thread, and the counters `/metrics` reports.

HTTP handlers (on the event loop) submit requests and abort them; the engine thread (its own, or with `run_here` the
caller's: one-process `behemoth serve` steps on its main thread, HTTP on another) owns the
scheduler's running batch and the KV cache and steps while there is work. Tokens go back to each
handler through its sink (a thread-safe hand-off to the event loop). An idle engine wakes on the next
submission; while idle it tells the other ranks of a sharded model that the job is alive. `busy_since` says
when the step in progress began, so that a watchdog (`liveness.py`) can fail an engine whose step never
returns (a tensor- or pipeline-parallel worker that hangs); `fail` ends every request from any thread.
"""

from __future__ import annotations

import bisect
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from behemoth.inference.runner import Runner
from behemoth.inference.sampling import SamplingParams
from behemoth.inference.scheduler import Event, Request, Scheduler

KEEPALIVE_S = 10.0
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        for j in range(i, len(self.buckets)):
            self.counts[j] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]


class ServeMetrics:
    """Counters of the server's requests and tokens, and histograms of latency and time to first token."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.responses: dict[int, int] = defaultdict(int)
        self.prompt_tokens = self.generated_tokens = 0
        self.ttft, self.latency = Histogram(), Histogram()

    def response(self, status: int) -> None:
        with self.lock:
            self.responses[status] += 1

    def finished(self, req: Request) -> None:
        with self.lock:
            self.prompt_tokens += len(req.prompt)
            self.generated_tokens += len(req.output)
            if req.first_token_at is not None:
                self.ttft.observe(req.first_token_at - req.arrival)
            self.latency.observe((req.finished_at or time.perf_counter()) - req.arrival)

    def render(self, gauges: dict[str, Any], stats: dict[str, int]) -> str:
        """The Prometheus text exposition format."""
        lines = ["# TYPE behemoth_http_responses_total counter"]
        with self.lock:
            lines += [f'behemoth_http_responses_total{{status="{s}"}} {n}' for s, n in sorted(self.responses.items())]
            counters = {
                "prompt_tokens_total": self.prompt_tokens,
                "generated_tokens_total": self.generated_tokens,
                **{f"scheduler_{k}_total": v for k, v in stats.items()},
            }
            for name, value in counters.items():
                lines += [f"# TYPE behemoth_{name} counter", f"behemoth_{name} {value}"]
            for name, hist in (("time_to_first_token_seconds", self.ttft), ("request_latency_seconds", self.latency)):
                lines += [f"# TYPE behemoth_{name} histogram", *hist.lines(f"behemoth_{name}")]
        for name, value in gauges.items():
            lines += [f"# TYPE behemoth_{name} gauge", f"behemoth_{name} {value}"]
        return "\n".join(lines) + "\n"


class EngineLoop:
    """The scheduler on a thread of its own: steps while there is work, waits for a submission when there is none."""

    def __init__(self, scheduler: Scheduler, runner: Runner, metrics: ServeMetrics | None = None) -> None:
        self.scheduler, self.runner = scheduler, runner
        self.metrics = metrics or ServeMetrics()
        self.wake = threading.Event()
        self.stopping = False
        self.error: str | None = None
        self.closing: str | None = None  # why new requests are refused while the server stops (it was signalled)
        self.busy_since: float | None = None  # monotonic time the step (or keepalive) in progress began; None while idle
        self.own = threading.Thread(target=self._loop, name="behemoth-engine", daemon=True)
        self.thread = self.own  # the thread that steps: its own, or the caller's (`run_here`)

    def start(self) -> EngineLoop:
        self.own.start()
        return self

    def run_here(self) -> None:
        """Step on the calling thread until `stop` (from another thread) or a failure. One process serving runs its engine
        so, on the main thread that loaded the model: the OpenMP runtime (libgomp) spins less once threads beyond the
        cores' count are managed, and a second thread starting parallel regions beside the main thread's idle team ran a
        decode step of the bench Llama about 1.5x slower than the main thread did (docs/serving.md, "Many clients at once")."""
        self.thread = threading.current_thread()
        self._loop()

    def submit(self, prompt: list[int], params: SamplingParams, sink: Callable[[Event], None]) -> Request:
        """Queue a request (QueueFull when the queue is at its bound) and wake the engine."""
        req = self.scheduler.submit(prompt, params, sink)
        self.wake.set()
        return req

    def abort(self, request_id: int) -> None:
        self.scheduler.abort(request_id)
        self.wake.set()

    @property
    def healthy(self) -> bool:
        return self.error is None and self.closing is None and self.thread.is_alive()

    def fail(self, reason: str) -> None:
        """Declare the engine failed (from any thread: its own may be stuck in a step that never returns): every request
        in flight ends with an error event, later ones are refused, /health answers 503 with `reason`."""
        if self.error is None:
            self.error = reason
            self._fail_all()
        self.wake.set()

    def _loop(self) -> None:
        last = time.monotonic()
        try:
            while not self.stopping and self.error is None:
                if self.scheduler.idle:
                    self.wake.wait(timeout=1.0)
                    self.wake.clear()
                    if time.monotonic() - last > KEEPALIVE_S:
                        self.busy_since = time.monotonic()
                        self.runner.keepalive()
                        last, self.busy_since = time.monotonic(), None
                    continue
                self.busy_since = time.monotonic()
                for req in self.scheduler.step():
                    self.metrics.finished(req)
                last, self.busy_since = time.monotonic(), None
        except Exception:  # a failed step: report unhealthy, end every request rather than hang its client
            self.fail(traceback.format_exc())

    def _fail_all(self) -> None:
        for req in list(self.scheduler.running) + list(self.scheduler.waiting):
            if req.sink is not None:
                req.sink(Event(req.id, None, "", "error"))

    def stop(self) -> None:
        """Finish the thread and tell the other ranks to stop (not after a failure: a peer may be dead or hung, and a
        failed engine's thread may be stuck in a collective; the launcher stops the other ranks)."""
        self.stopping = True
        self.wake.set()
        if self.error is not None:
            return
        if self.thread is self.own:
            if self.own.ident is not None:
                self.own.join(timeout=60)
        elif self.thread is not threading.current_thread():  # stepping on a caller's thread (`run_here`): the caller
            return  # stops the engine again once its loop has returned, and the runner closes then
        self.runner.close()
