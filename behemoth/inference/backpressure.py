"""A streaming client that stops reading: its stream is cancelled, not left holding KV blocks and generating.

A stream's bytes pass from the server to the connection's transport buffer and the kernel's send queue, where they
wait until the client's TCP stack takes (acknowledges) them. A client whose application stops reading fills its own
receive window, and from then on every new token's bytes wait on the server's side. `StreamGuard` watches that
backlog (the transport's buffer plus the socket's unacknowledged bytes, Linux's SIOCOUTQ) every `every_s` seconds and
cancels the stream when the backlog exceeds `max_unsent_bytes`, or when it is non-empty and the client has taken no
byte of it for `idle_timeout_s`: the stream's generations are aborted (their KV blocks go back at the next engine
step) and the connection is closed (uvicorn then ends the response, which gives the stream slot back). The check runs
beside the response, so it also catches a stream whose write is blocked. Other streams are not touched.

The connection's transport is taken from the ASGI server's `send` (uvicorn's `RequestResponseCycle.transport`) by
`TransportTap`, the outermost layer of the application; under a server without one, only the engine side is guarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import Any

TRANSPORT_KEY = "behemoth.transport"


class TransportTap:
    """ASGI layer that puts the connection's transport (when the server's `send` has one) in the scope."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope[TRANSPORT_KEY] = getattr(getattr(send, "__self__", None), "transport", None)
        await self.app(scope, receive, send)


def unsent_bytes(transport: Any) -> int:
    """Bytes written to the connection that the client has not acknowledged: the transport's buffer and, on Linux, the
    socket's send queue (SIOCOUTQ: unsent and unacknowledged)."""
    n = int(transport.get_write_buffer_size())
    sock = transport.get_extra_info("socket")
    if sock is not None and sys.platform.startswith("linux"):
        import fcntl
        import struct
        import termios

        with contextlib.suppress(OSError, ValueError):
            n += struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    return n


class StreamGuard:
    """Watches one stream's backlog; cancels it (aborts its generations, closes its connection) when its client has
    stopped taking bytes. `wrote(n)` counts the bytes the stream hands to the server."""

    def __init__(self, transport: Any, abort: Any, name: str, *, max_unsent_bytes: int, idle_timeout_s: float, every_s: float = 0.1) -> None:
        self.transport, self.abort, self.name = transport, abort, name
        self.max_unsent, self.idle_s, self.every_s = max_unsent_bytes, idle_timeout_s, every_s
        self.written = 0
        self.cancelled: str | None = None
        self.task: asyncio.Task[None] | None = None

    def start(self) -> StreamGuard:
        if self.transport is not None:
            self.task = asyncio.get_running_loop().create_task(self._watch())
        return self

    def wrote(self, n: int) -> None:
        self.written += n

    def stop(self) -> None:
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()

    def reason(self, backlog: int, since: float, now: float) -> str | None:
        """Why the stream is cancelled now, or None while its client keeps up."""
        if backlog > self.max_unsent:
            return f"{backlog} bytes written that its client has not taken, over the limit of {self.max_unsent} (--stream-max-unsent-kb)"
        if backlog > 0 and now - since > self.idle_s:
            return f"its client has taken none of its {backlog} waiting bytes for {now - since:.1f} s (--stream-idle-timeout-s {self.idle_s:g})"
        return None

    async def _watch(self) -> None:
        best, since = 0, time.monotonic()
        while not self.transport.is_closing():
            await asyncio.sleep(self.every_s)
            backlog, now = unsent_bytes(self.transport), time.monotonic()
            taken = self.written - backlog  # what the client's TCP has acknowledged (less the HTTP framing)
            if backlog == 0 or taken > best:
                best, since = max(best, taken), now
            why = self.reason(backlog, since, now)
            if why is not None:
                self.cancel(why)
                return

    async def passing(self, chunks: Any) -> Any:
        """The stream's chunks, each counted as written; the guard stops with the stream."""
        try:
            async for chunk in chunks:
                self.wrote(len(chunk))
                yield chunk
        finally:
            self.stop()
            await chunks.aclose()

    def cancel(self, why: str) -> None:
        self.cancelled = why
        print(f"behemoth: stream {self.name} cancelled: {why}; its generations are aborted and its KV blocks freed", file=sys.stderr, flush=True)
        self.abort()
        self.transport.abort()  # the connection closes at once (a close would wait for the client to read)
