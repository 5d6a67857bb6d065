"""`BoundedCalls.run` and cancellation: a caller cancelled as its call ends stays cancelled
(a shutdown's cancel of a polling loop is never lost to a result arriving at that moment)."""

from __future__ import annotations

import asyncio
import threading
import time

from hub.dependencies.calls import BoundedCalls


def block_until_returned(calls: BoundedCalls) -> None:
    """Hold the calling thread (the event loop's) until the worker's call has returned."""
    while calls.busy:
        time.sleep(0.001)
    time.sleep(0.05)  # the worker sets the result right after it frees its slot


async def test_a_cancellation_arriving_as_the_call_ends_is_kept() -> None:
    calls = BoundedCalls("sql", workers=1, deadline=5.0)
    loop = asyncio.get_running_loop()
    started, go = threading.Event(), threading.Event()

    def work() -> int:
        started.set()
        go.wait(5)
        # The cancellation reaches the loop a few callbacks behind the result: after the
        # result is in, before the waiting caller has resumed.
        loop.call_soon_threadsafe(lambda: loop.call_soon(lambda: loop.call_soon(task.cancel)))
        return 1

    task = asyncio.create_task(calls.run(work))
    await asyncio.to_thread(started.wait, 5)
    go.set()
    # The loop is held until the worker has returned: result, then cancel, arrive queued.
    block_until_returned(calls)
    try:
        result = await task
    except asyncio.CancelledError:
        return
    raise AssertionError(f"the cancellation was dropped and the call's result ({result}) returned")
