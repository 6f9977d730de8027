"""A thread that publishes this rank's snapshot to the job's store every `interval` seconds, and reads the peers' back.

A peer whose last heartbeat is older than `stale_s` has stopped publishing: it is stopped, hung or dead. Each beat
also runs a callback (the watchdog). Without a store (no job of several ranks, or its host died) nothing is
published and a diagnosis sees this rank's ring only.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import torch.distributed as dist

from behemoth.flight.ring import Snapshot

MAX_FAILED_BEATS = 5  # consecutive failed publishes after which the store is taken as gone


def heartbeat_store(timeout_s: float) -> Any:
    """A store client of this job's own for the heartbeats (the launcher's store when there is one), under a prefix
    unique to this attempt of the run."""
    base: Any
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        base = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=max(5.0, timeout_s))
        )
    else:
        base = dist.distributed_c10d._get_default_store()
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return dist.PrefixStore(f"behemoth/flight/{attempt}/", base)


def beat_interval(timeout_s: float) -> float:
    """Seconds between heartbeats: a tenth of c10d's timeout, within [0.5, 2]."""
    return min(2.0, max(0.5, timeout_s / 10))


def stale_after(interval: float) -> float:
    """How old a peer's last heartbeat may be before the peer counts as stopped: three missed beats and a second."""
    return 3 * interval + 1.0


class Heartbeat:
    """Publishes `snapshot()` under this rank's number and runs `on_beat()` after each publish, on a daemon thread."""

    def __init__(self, rank: int, timeout_s: float, snapshot: Callable[[], Snapshot], on_beat: Callable[[], None]) -> None:
        self.rank, self.interval = rank, beat_interval(timeout_s)
        self.snapshot, self.on_beat = snapshot, on_beat
        self.store: Any = None
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.last_tick = time.time()
        self.gaps: list[tuple[float, float]] = []  # (when it ended, seconds): the beats' late wake-ups, newest last

    @property
    def stale_s(self) -> float:
        return stale_after(self.interval)

    def start(self, store: Any) -> None:
        """Publish at once (a rank that stops right away has still said where it was), then every `interval`."""
        self.store, self.last_tick = store, time.time()
        self.publish()
        self.stop_event.clear()
        self.thread = threading.Thread(target=self._beat, name="behemoth-flight", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.thread is not None:
            self.stop_event.set()
            self.thread.join(timeout=5)
            self.thread = None
        self.store = None

    @property
    def running(self) -> bool:
        return self.thread is not None

    def publish(self) -> bool:
        """Put this rank's snapshot in the store; False if that failed."""
        try:
            if self.store is not None:
                self.store.set(str(self.rank), json.dumps(self.snapshot()))
            return True
        except Exception:
            return False

    def published(self, rank: int) -> Snapshot | None:
        """A peer's last heartbeat, if it published one."""
        try:
            if self.store is not None and self.store.check([str(rank)]):
                return cast(Snapshot, json.loads(self.store.get(str(rank))))
        except Exception:
            return None
        return None

    def not_running_since(self, since: float, now: float) -> float:
        """The longest stretch since `since` in which this process did not run (stopped, suspended or starved): the
        beat thread woke that much later than it asked to, or has not woken for that long now."""
        late = [gap for end, gap in self.gaps if end >= since]
        return max([now - self.last_tick - self.interval, *late, 0.0])

    def _beat(self) -> None:
        failures = 0
        while not self.stop_event.wait(self.interval):
            now = time.time()
            gap, self.last_tick = now - self.last_tick - self.interval, now
            if gap > self.stale_s:
                self.gaps = [*self.gaps[-7:], (now, gap)]
            failures = 0 if self.publish() else failures + 1
            if failures > MAX_FAILED_BEATS:  # the store is gone (its host died): diagnoses use this rank's ring only
                self.store = None
            self.on_beat()
