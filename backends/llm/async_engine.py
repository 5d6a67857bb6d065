"""The engine's step loop in its own thread, behind asyncio streams.

`submit` validates a request synchronously (so a bad one fails before any response starts)
and returns a `RequestStream`: an async iterator of `RequestOutput` deltas that ends when
every sample of the request has finished. Closing the stream early (a client disconnect, a
timeout, a cancelled task) aborts the request; the engine frees its blocks at the next step
boundary, at most one step later. The thread sleeps while there is no work and hands each
step's outputs to the event loops in one call per loop, as the next step's forward starts
(the forward releases the GIL: the loop streams them meanwhile, where handing them over
before the next step's scheduling made that scheduling wait for the loop), or at once when
no forward follows.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import uuid
from collections.abc import AsyncIterator
from types import TracebackType

import torch

from backends.errors import BackendClosedError
from backends.llm.engine import EngineStepError, LLMEngine, RequestOutput
from backends.llm.sampling_params import SamplingParams
from backends.threads import start_thread_with

log = logging.getLogger(__name__)

_Item = list[RequestOutput] | BaseException


class RequestStream:
    """One request's deltas. Use as `async with stream: async for out in stream: ...`, or
    call `abort()`; either way an unfinished request is aborted in the engine."""

    def __init__(self, owner: AsyncLLMEngine, request_id: str, n: int) -> None:
        self.request_id = request_id
        self._owner = owner
        self._remaining = n
        # Delivered, not yet iterated; then the error that ended the stream, if any.
        self._pending: collections.deque[RequestOutput] = collections.deque()
        self._error: BaseException | None = None
        # The iterating task's wait for the next delivery: one future per wait, set by
        # `_deliver` on the loop (cheaper than a queue's getter bookkeeping per token).
        self._waiter: asyncio.Future[None] | None = None
        self._loop = asyncio.get_running_loop()  # the one its deltas arrive on
        self._closed = False

    @property
    def finished(self) -> bool:
        return self._remaining == 0

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while not self._pending:
            if self._remaining == 0 or self._closed:
                self._close()
                raise StopAsyncIteration
            if self._error is not None:
                self._close()
                raise self._error
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        out = self._pending.popleft()
        if out.finished:
            self._remaining -= 1
        return out

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.abort()

    def abort(self) -> None:
        """Stop the request now if it has not finished; idempotent."""
        if self._remaining and not self._closed:
            self._owner.engine.abort_request(self.request_id)
            self._owner.wake()
        self._close()

    def _deliver(self, item: _Item) -> None:
        """On the stream's loop: queue outputs, or the error raised once they are taken."""
        if isinstance(item, BaseException):
            if self._error is None:
                self._error = item
        else:
            self._pending.extend(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._owner._forget(self.request_id)


# One event loop's share of a step's outputs: each stream with its deltas.
_Batch = list[tuple[RequestStream, list[RequestOutput]]]


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, *, name: str = "llm", threads: int | None = None) -> None:
        """Start the step thread; its torch ops run on `threads` threads from its start,
        other threads' counts unchanged (None: the count threads start with)."""
        self.engine = engine
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, RequestStream]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._counted = threading.Event()
        # Outputs not yet handed to their event loops (the engine thread's own).
        self._outbox: dict[asyncio.AbstractEventLoop, _Batch] = {}
        self._forwarded = False
        engine.runner.before_forward = self._forward_starts
        self._thread = threading.Thread(target=self._run, name=f"engine {name}", daemon=True)
        start_thread_with(threads, self._thread, self._counted)

    @property
    def closed(self) -> bool:
        return self._stopping

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        request_id: str | None = None,
        adapter: str | None = None,
    ) -> RequestStream:
        """Queue a request (InputError / CapacityError raised here) and return its stream.
        Call from a running event loop; the stream's deltas arrive on it."""
        if self._stopping:
            raise BackendClosedError("the LLM engine is shut down")
        loop = asyncio.get_running_loop()
        request_id = request_id or uuid.uuid4().hex
        stream = RequestStream(self, request_id, params.n)
        with self._lock:
            self._streams[request_id] = (loop, stream)
        try:
            self.engine.add_request(
                request_id, prompt_token_ids, params, priority=priority, adapter=adapter
            )
        except BaseException:
            self._forget(request_id)
            raise
        self._wake.set()
        return stream

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        adapter: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """`submit` and iterate; leaving the loop early aborts the request."""
        stream = self.submit(prompt_token_ids, params, priority=priority, adapter=adapter)
        async with stream:
            async for out in stream:
                yield out

    def wake(self) -> None:
        self._wake.set()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step; open streams fail with BackendClosedError."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        self._fail_streams(BackendClosedError("the LLM engine was shut down"))

    # ---- engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            torch.get_num_threads()  # takes the start-up count now (`start_thread_with`)
        finally:
            self._counted.set()
        while not self._stopping:
            self._wake.clear()
            if not self.engine.has_work():
                self._flush()
                self._wake.wait(timeout=1.0)
                continue
            self._forwarded = False
            try:
                outputs = self.engine.step()
            except EngineStepError as e:
                self._flush()  # what earlier steps produced goes first
                if e.errors:  # requests to blame alone; the others go on
                    for request_id, error in e.errors.items():
                        self._fail_streams(error, [request_id])
                else:
                    self._fail_streams(e, e.request_ids)
                continue
            except Exception as e:  # a bug outside the model: fail loudly, keep the thread
                log.exception("LLM engine loop failed")
                self._flush()
                self._fail_streams(e)
                continue
            if not self._forwarded:  # no forward ran to hand them over during
                self._flush()
            if outputs:
                self._post(outputs)
                if self.engine.in_flight:
                    # An asynchronous step: the next forward started before these landed,
                    # so no forward start is left to hand them over; do it now.
                    self._flush()
        self._flush()

    def _forward_starts(self) -> None:
        self._forwarded = True
        self._flush()

    def _post(self, outputs: list[RequestOutput]) -> None:
        """Put a step's outputs in the outbox, grouped by stream and by event loop."""
        grouped: dict[str, list[RequestOutput]] = {}
        for out in outputs:
            grouped.setdefault(out.request_id, []).append(out)
        with self._lock:
            for request_id, outs in grouped.items():
                entry = self._streams.get(request_id)
                if entry is not None:
                    self._outbox.setdefault(entry[0], []).append((entry[1], outs))

    def _flush(self) -> None:
        """Hand the outbox to its event loops, one call per loop."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        for loop, batch in outbox.items():
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody listens
                loop.call_soon_threadsafe(_dispatch, batch)

    def _fail_streams(self, error: BaseException, request_ids: list[str] | None = None) -> None:
        """Deliver `error` to the streams of `request_ids` (all streams when None)."""
        with self._lock:
            if request_ids is None:
                entries = list(self._streams.values())
            else:
                entries = [self._streams[r] for r in request_ids if r in self._streams]
        for loop, stream in entries:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stream._deliver, error)

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)


def _dispatch(batch: _Batch) -> None:
    for stream, outs in batch:
        stream._deliver(outs)
