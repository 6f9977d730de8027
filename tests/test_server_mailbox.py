"""The engine thread's events reach the HTTP event loop all of them, in order, with one wake-up of the loop for what
was posted while it was busy (inference/server.py's Mailbox)."""

from __future__ import annotations

import asyncio
import threading

from behemoth.inference.server import mailbox


def test_events_posted_while_the_loop_is_busy_arrive_in_order_after_one_wake_up():
    async def run() -> tuple[list[tuple[int, int]], int, bool]:
        loop = asyncio.get_running_loop()
        box = mailbox(loop)
        queues: list[asyncio.Queue] = [asyncio.Queue(), asyncio.Queue()]
        wakeups = 0
        schedule = loop.call_soon_threadsafe

        def counted(callback, *args):  # the loop's wake-ups the mailbox asks for
            nonlocal wakeups
            wakeups += 1
            return schedule(callback, *args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        engine = threading.Thread(target=lambda: [box.post(queues[i % 2], (i % 2, i)) for i in range(64)])
        engine.start()
        engine.join()  # the loop is blocked here, as it is while it writes a response: the 64 events wait for it
        got = [await asyncio.wait_for(queues[i % 2].get(), 10) for i in range(64)]
        return got, wakeups, mailbox(loop) is box and all(q.empty() for q in queues)

    got, wakeups, one_box_and_nothing_left = asyncio.run(run())
    assert got == [(i % 2, i) for i in range(64)]  # every event, each queue's in the order posted
    assert wakeups == 1 and one_box_and_nothing_left
