"""Blocking database calls from the event loop: on threads of their own, with a deadline.

The hub's background SQL (replica heartbeats, traffic statistics flushes, canary leases) must
neither block the event loop nor wait for a database that stopped answering: each call runs
on a small thread pool and is awaited at most `timeout` seconds, then abandoned (shielded,
not cancelled: a thread cannot be interrupted; the engine's own connect, statement and TCP
timeouts end it, see `registry.replicas.membership_engine`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class SqlWorker:
    """Blocking SQL calls run on `threads` threads of their own, each awaited at most
    `timeout` seconds (then abandoned, not cancelled: the database's timeouts end it)."""

    def __init__(self, timeout: float, *, name: str, threads: int = 2) -> None:
        self.timeout = timeout
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)

    def submit(self, call: Callable[[], T]) -> asyncio.Future[T]:
        future = asyncio.get_running_loop().run_in_executor(self._executor, call)
        future.add_done_callback(consume)
        return future

    async def wait(self, future: asyncio.Future[T]) -> T:
        async with asyncio.timeout(self.timeout):
            return await asyncio.shield(future)

    async def call(self, call: Callable[[], T]) -> T:
        return await self.wait(self.submit(call))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def consume(future: asyncio.Future[Any]) -> None:
    # An abandoned call's error is reported where it was awaited; keep asyncio from logging
    # "exception was never retrieved" when it finally returns.
    if not future.cancelled():
        future.exception()


def failure_reason(e: BaseException, timeout_setting: str) -> str:
    """One line saying why a SQL call failed (`timeout_setting` names the setting that bounds
    the wait, for a timeout)."""
    if isinstance(e, TimeoutError):
        return f"no answer within {timeout_setting}"
    from registry.outage import describe  # SQLAlchemy's classes, only once something failed

    return describe(e)  # an outage without its driver's text (hosts, ports)
