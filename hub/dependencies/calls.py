"""Blocking calls to one dependency on a few threads of its own, each awaited with a deadline.

`asyncio.to_thread` shares one small default executor (min(32, cores + 4) threads) with
everything else the hub does off the event loop. During an MLflow outage each call there
would sit in MLflow's retries for minutes, so probes and admin calls would pile up threads
until unrelated work waited for one. `BoundedCalls` gives a dependency its own few
threads and refuses, at once, a call made while they are all busy: an outage costs at most
`workers` threads however many callers come, and no caller waits behind stuck calls.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from registry.errors import DependencyUnavailable
from registry.outage import outage_named

T = TypeVar("T")


def _retrieve(future: Future[Any]) -> None:
    # A call abandoned at its deadline finishes later; its outcome is read here so it is
    # never reported as "exception never retrieved".
    if not future.cancelled():
        future.exception()


class BoundedCalls:
    """Runs blocking calls to `dependency` on at most `workers` threads.

    Contract: `run(fn, ...)` returns `fn`'s result, or raises DependencyUnavailable when all
    workers are busy (immediately, nothing queues), when the call outlives `deadline`
    seconds (the thread finishes in the background and keeps its slot until then; the
    client's own timeouts bound that), or when `fn` failed because the dependency did not
    answer. Any other exception of `fn` propagates unchanged.
    """

    def __init__(self, dependency: str, *, workers: int, deadline: float | None) -> None:
        self.dependency = dependency
        self.workers = workers
        self.deadline = deadline
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix=f"hub-{dependency}")
        self._lock = threading.Lock()
        self._running = 0

    @property
    def busy(self) -> int:
        """Calls running now (abandoned ones included until their thread returns)."""
        return self._running

    def _take_slot(self) -> bool:
        with self._lock:
            if self._running >= self.workers:
                return False
            self._running += 1
            return True

    def _release_slot(self) -> None:
        with self._lock:
            self._running -= 1

    async def run(
        self, fn: Callable[..., T], *args: Any, deadline: float | bool | None = True, **kwargs: Any
    ) -> T:
        """`fn(*args, **kwargs)` on a worker; `deadline`: True for the default, None for no
        deadline (a registration uploads files for as long as they take), or seconds."""
        limit = self.deadline if deadline is True else deadline
        what = getattr(fn, "__name__", "a call")
        if not self._take_slot():
            raise DependencyUnavailable(
                f"{self.dependency}: all {self.workers} connections are busy with earlier calls "
                f"that have not returned ({what} not started); it is slow or down, retry shortly",
                dependency=self.dependency,
            )
        try:
            future = self._executor.submit(self._call, functools.partial(fn, *args, **kwargs))
        except BaseException:
            self._release_slot()
            raise
        future.add_done_callback(_retrieve)
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns the result of a
            # call that ends as the caller is cancelled and drops the cancellation (a loop
            # being shut down then runs on).
            with outage_named(f"{self.dependency} ({what})"):
                async with asyncio.timeout(limit):
                    return await asyncio.shield(asyncio.wrap_future(future))
        except TimeoutError:
            raise DependencyUnavailable(
                f"{self.dependency} did not answer {what} within {limit:g}s; retry once it is back",
                dependency=self.dependency,
            ) from None

    def _call(self, call: Callable[[], T]) -> T:
        try:
            return call()
        finally:
            self._release_slot()

    def close(self) -> None:
        """Stop taking calls; threads still stuck finish on their own (never joined here)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
