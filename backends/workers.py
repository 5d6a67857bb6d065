"""Threads of their own for each kind of blocking work; pure Python.

asyncio's default executor (`asyncio.to_thread`) is shared by everything that uses it, the
event loop's DNS lookups included, and has min(32, cores + 4) threads: one kind of work that
fills it (a burst of grammar compiles, calls to a database that stopped answering) stalls
every other kind. So each kind of blocking work the hub does while serving runs on a pool
of its own, and waits behind its own kind only:

- grammar compiles: the hub's `CompilePool` (backends/llm/structured/pool.py), shared
  fairly between callers;
- loads (prepare, predict, load, restore) and evictions (park, unload): the model
  manager's "model-loads" and "model-evictions" `WorkerPool`s, so a stuck load never keeps
  a model from being evicted;
- API-key checks that miss the cache: the authenticator's "auth" pool;
- registry snapshots: the catalog's "catalog" pool; admin SQL: the control's
  "registry-sql" pool (MLflow calls: its `BoundedCalls`, with deadlines);
- tokenizing: each LLM's own tokenizer thread; background SQL: `hub.sql_worker`;
- a backend stopping its workers before an unload (`aclose`, once per eviction): a thread
  of its own for the call (`on_own_thread`).

The default executor is left to start-up steps that nothing waits behind.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class WorkerPool:
    """Blocking calls of one kind on `threads` threads of their own, awaited like
    `asyncio.to_thread` (context variables included); calls beyond `threads` wait their turn
    here, never for another kind's. Threads start on first use."""

    def __init__(self, name: str, threads: int) -> None:
        self.name = name
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on one of this pool's threads."""
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def close(self) -> None:
        """Take no more calls; calls already running finish on their own."""
        self._executor.shutdown(wait=False, cancel_futures=True)


async def on_own_thread(fn: Callable[[], T], *, name: str) -> T:
    """`fn()` on a new thread of its own: for rare blocking calls (a backend stopping its
    workers) that must not wait behind any pool, however busy."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result = fn()
        except BaseException as e:
            loop.call_soon_threadsafe(settle, None, e)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=contextvars.copy_context().run, args=(run,), name=name).start()
    return await future
