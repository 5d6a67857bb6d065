"""Grammar compiles on a few threads of their own, shared fairly between callers.

A compile runs in native code that cannot be interrupted, for milliseconds usually and for
as long as its size limit allows at worst. On a shared executor (asyncio's default one, which
loads, evictions, auth and the catalog use too) a burst of large compiles held every thread
and stalled all of those. `CompilePool` keeps compiles on `threads` threads that nothing else
uses, and bounds what one caller may hold:

- a caller's compiles run one at a time, and callers take turns for free threads, so one
  caller never holds more than one thread while another's compile waits;
- a caller holds at most `per_caller` compiles (queued, running, or running on after their
  requests gave up), and one more is refused at once (CapacityError: 503 + Retry-After);
- a compile equal (by key) to one queued or running is joined, not repeated;
- a compile whose every waiter left (the client went away, or its time limit passed) before
  it started never starts; one already running finishes and its result is cached by the
  compiler as usual.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from backends.errors import CapacityError

T = TypeVar("T")

DEFAULT_THREADS = 2
DEFAULT_PER_CALLER = 4


@dataclass(eq=False)
class _Job:
    key: Hashable
    caller: str
    fn: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)
    waiters: int = 0
    started: bool = False


class CompilePool:
    """Runs compiles on `threads` threads of its own; see the module docstring for the
    sharing rules. Thread-safe; `run` may be awaited from any event loop."""

    def __init__(
        self, threads: int = DEFAULT_THREADS, per_caller: int = DEFAULT_PER_CALLER
    ) -> None:
        if threads < 1 or per_caller < 1:
            raise ValueError("a compile pool needs at least one thread and one compile a caller")
        self.threads = threads
        self.per_caller = per_caller
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._jobs: dict[Hashable, _Job] = {}  # queued or running, by key
        # Callers with queued jobs, in turn order; each caller's jobs in arrival order.
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()
        self._running: set[str] = set()  # callers with a job on a thread
        self._held: Counter[str] = Counter()  # jobs per caller, queued or running
        self._closed = False

    def held(self, caller: str) -> int:
        """Compiles `caller` holds now (queued or running)."""
        with self._lock:
            return self._held[caller]

    def queued(self) -> int:
        """Compiles waiting for a thread."""
        with self._lock:
            return sum(len(q) for q in self._queues.values())

    async def run(
        self, key: Hashable, fn: Callable[[], T], *, caller: str, limit_s: float | None
    ) -> T:
        """`fn()`'s result (or exception), computed on a pool thread once for every waiter
        with an equal `key`. CapacityError at once when `caller` holds `per_caller`
        compiles, or `limit_s` seconds after the call when the result is not ready."""
        with self._lock:
            if self._closed:
                raise CapacityError("grammar compiles are shut down", retry_after=1.0)
            job = self._jobs.get(key)
            if job is None:
                if self._held[caller] >= self.per_caller:
                    raise CapacityError(
                        f"{caller} already has {self._held[caller]} grammar compiles in "
                        f"progress, the most one caller may have (hub setting "
                        "structured_outputs.compiles_per_caller); retry once they finish",
                        retry_after=1.0,
                    )
                job = self._jobs[key] = _Job(key, caller, fn)
                self._held[caller] += 1
                self._queues.setdefault(caller, deque()).append(job)
            job.waiters += 1
            self._dispatch()
        try:
            outcome = asyncio.wrap_future(job.future)
            outcome.add_done_callback(_retrieve)
            # asyncio.timeout, not wait_for, which on Python 3.11 can drop a cancellation
            # arriving as the compile ends.
            async with asyncio.timeout(limit_s):
                result: T = await asyncio.shield(outcome)
            return result
        except TimeoutError:
            raise CapacityError(
                f"the grammar did not compile within {limit_s:g}s (this model's runtime config "
                "grammar_compile_timeout_ms): the compiles are busy or the grammar is large; "
                "retry later, or send a smaller one",
                retry_after=max(1.0, float(limit_s or 0)),
            ) from None
        finally:
            with self._lock:
                job.waiters -= 1
                if job.waiters == 0 and not job.started and not job.future.done():
                    self._abandon(job)

    def _abandon(self, job: _Job) -> None:
        """Drop a queued job nobody waits for any more (lock held)."""
        queue = self._queues.get(job.caller)
        if queue is not None and job in queue:
            queue.remove(job)
            if not queue:
                del self._queues[job.caller]
        del self._jobs[job.key]
        self._held[job.caller] -= 1
        if not self._held[job.caller]:
            del self._held[job.caller]
        job.future.cancel()

    def _dispatch(self) -> None:
        """Start queued jobs while threads are free, one caller after another (lock held)."""
        while len(self._running) < self.threads:
            caller = next((c for c in self._queues if c not in self._running), None)
            if caller is None:
                return
            queue = self._queues.pop(caller)
            job = queue.popleft()
            if queue:  # its next job waits for its turn behind the other callers
                self._queues[caller] = queue
            job.started = True
            self._running.add(caller)
            self._executor.submit(self._execute, job)

    def _execute(self, job: _Job) -> None:
        try:
            result = job.fn()
        except BaseException as e:
            outcome: tuple[Any, BaseException | None] = (None, e)
        else:
            outcome = (result, None)
        with self._lock:
            del self._jobs[job.key]
            self._running.discard(job.caller)
            self._held[job.caller] -= 1
            if not self._held[job.caller]:
                del self._held[job.caller]
            if not self._closed:
                self._dispatch()
        if outcome[1] is not None:
            job.future.set_exception(outcome[1])
        else:
            job.future.set_result(outcome[0])

    def close(self) -> None:
        """Refuse new compiles and drop queued ones; running ones finish on their own."""
        with self._lock:
            self._closed = True
            for queue in self._queues.values():
                for job in queue:
                    self._jobs.pop(job.key, None)
                    job.future.cancel()
            self._queues.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _retrieve(future: asyncio.Future[Any]) -> None:
    # A compile whose waiter gave up at its time limit may fail later; its outcome is read
    # here so that it is never reported as "exception never retrieved".
    if not future.cancelled():
        future.exception()
