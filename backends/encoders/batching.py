"""Token-budget dynamic batching, shared by the encoder backends (embedder, reranker).

Contract: `await batcher.submit(payload, size)` returns one result per input of the payload, in
input order, whatever batches its inputs ran in. The batcher knows nothing about models: a
`BatchStages` object turns payloads into tokenized items (`tokenize`) and runs a list of items
through the model (`forward`).

    submit() --payloads--> [tokenizer thread] --items, kept sorted by length--> pool
    pool --one batch under the token budget--> [forward thread(s)] --results--> futures

The tokenizer thread tokenizes everything that has arrived in one call while the forward thread
runs the batch in flight, so tokenizing overlaps the forward pass (torch releases the GIL in its
kernels, the Rust tokenizer in its batch encode). A payload the stages refuse (an input too long,
a token id out of range) fails as a whole, before any of it reaches the model.

Batches. Whenever a forward thread is free it takes the oldest pooled input of the best-ranked
priority level (`backends.encoders.batch_queue`: interactive ahead of standard ahead of batch,
with aging) and grows a batch around it in length order while the next input costs less in the
batch than in a pass of its own: a pass costs a fixed `batch_overhead_tokens` plus its
`size * longest` padded tokens, so an input joins while the padding it adds (its own, or that
of every input it makes longer) is at most that overhead plus its own length;
`size * longest <= max_batch_tokens` and `size <= max_batch_size` bound it. A model that runs
batches unpadded (`BatchLimits.unpadded`) pays only for real tokens, so its batches grow to the
budgets, which then count real tokens. Starting from the oldest input (of a level, aged) means
no input starves; the cost rule groups similar lengths where a pass is cheap (a CPU) and fills
whole batches where it is dear (a GPU). One payload's inputs may land in several batches
and are reassembled in order. An idle model waits up to `batch_wait_s` after the oldest
input arrived, but only while the pool is smaller than the previous batch: a steady stream of
concurrent requests gets full batches, a lone client pays no wait. With several forward threads
(`forward_workers`) each runs its own batch.

Capacity. At most `max_queue` inputs wait (not yet in a forward pass); beyond that `submit`
raises `CapacityError`. With `max_queue_time_s` set, a request whose estimated wait (the inputs
ahead of it times the measured seconds per input, plus what is left of the passes in flight,
plus the work the other models on the same device have outstanding: `backends.encoders.batch_work`,
`backends.admission`) exceeds it is refused the same way at once, so that a burst is shed
rather than absorbed. A cancelled `submit` (the client went away) drops its inputs that have
not run yet. Results resolve on the submitting event loop via `call_soon_threadsafe`, once
per batch and loop.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic

from backends.admission import DeviceWork, QueueTimeAdmission
from backends.encoders.batch_items import (
    BatchStages,
    I,
    P,
    PendingRequest,
    PooledInput,
    R,
    pool_order,
)
from backends.encoders.batch_limits import BatchLimits
from backends.encoders.batch_metrics import BatchMetrics
from backends.encoders.batch_queue import SeedQueue
from backends.encoders.batch_work import BatchWork
from backends.errors import BackendClosedError, CapacityError, InputError

log = logging.getLogger(__name__)


class DynamicBatcher(Generic[P, I, R]):
    """A queue, a tokenizer thread and a forward thread for one loaded model."""

    def __init__(
        self,
        stages: BatchStages[P, I, R],
        limits: BatchLimits,
        *,
        name: str,
        metrics: BatchMetrics | None = None,
        on_worker_start: Callable[[], None] | None = None,
        device_work: DeviceWork | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """Start the threads; `on_worker_start` runs first thing in each forward thread (to
        set per-thread state such as torch's intra-op thread count). `device_work`: the
        device's view of every model's outstanding work, which this batcher joins and its
        admission reads; `clock` times the passes in flight for that estimate."""
        self.stages = stages
        self._on_worker_start = on_worker_start
        self.limits = limits
        self.name = name
        self._metrics = metrics
        # One lock; the tokenizer thread waits for arrivals, forward threads for pooled inputs
        # (separate conditions, so an arrival does not wake every forward thread).
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._pooled = threading.Condition(self._lock)
        self._incoming: deque[PendingRequest[P, R]] = deque()  # submitted, not yet tokenized
        self._pool: list[PooledInput[I]] = []  # tokenized, sorted by (length, arrival)
        # The same slots in arrival order per priority level: where each batch starts.
        self._seeds: SeedQueue[I] = SeedQueue(limits.priority_aging_batches)
        self._queued = 0  # inputs submitted and not yet in a forward pass
        self._last_batch_size = 1
        self._seq = itertools.count()
        self._closed = False
        # Measures the service rate from every pass; refuses only with max_queue_time_s set.
        self.admission = QueueTimeAdmission(
            limits.max_queue_time_s,
            name=name,
            workers=limits.forward_workers,
            min_retry_after_s=limits.retry_after_s,
        )
        # The queue and the passes in flight as admission and the device see them.
        self.work = BatchWork(self.admission, lambda: self._queued, clock)
        self._threads = [
            threading.Thread(target=self._tokenize_loop, name=f"{name} tokenize", daemon=True),
        ]
        self._threads += [
            threading.Thread(target=self._forward_loop, name=f"{name} forward {i}", daemon=True)
            for i in range(limits.forward_workers)
        ]
        for thread in self._threads:
            thread.start()
        self.set_device_work(device_work)

    @property
    def queued(self) -> int:
        """Inputs waiting for a forward pass."""
        return self._queued

    def set_device_work(self, device_work: DeviceWork | None) -> None:
        """Count this model's work on `device_work` (the device it now runs on) instead of
        the previous one's; a closed batcher counts nowhere."""
        with self._lock:
            self.work.count_on(None if self._closed else device_work)

    def outstanding_s(self) -> float:
        """Seconds of work this model has outstanding (`BatchWork.outstanding_s`); callable
        from any thread."""
        return self.work.outstanding_s()

    async def submit(self, payload: P, size: int, *, priority: int = 0) -> list[R]:
        """Results for the `size` inputs of `payload`, in order; `priority` is the request's
        level (`backends.priority`, lower first). Raises the stages' error for a refused
        payload, InputError when `size` exceeds `max_queue`, CapacityError when the queue
        has no room for it now, BackendClosedError once closed."""
        if size < 1:
            raise ValueError("a request needs at least one input")
        if size > self.limits.max_queue:
            raise InputError(
                f"{size} inputs in one request is more than {self.name} queues "
                f"({self.limits.max_queue}, runtime config max_queue); split the request"
            )
        loop = asyncio.get_running_loop()
        request: PendingRequest[P, R] = PendingRequest(payload, size, loop, priority)
        with self._lock:
            if self._closed:
                raise BackendClosedError(f"{self.name} is shut down")
            if self._queued + size > self.limits.max_queue:
                self._shed("queue_full")
                raise CapacityError(
                    f"{self.name}: {self._queued} inputs already wait and this request adds "
                    f"{size} (max_queue {self.limits.max_queue}); retry later",
                    retry_after=self.limits.retry_after_s,
                )
            try:
                self.work.admit(size)
            except CapacityError:
                self._shed("queue_time")
                raise
            self._queued += size
            self._incoming.append(request)
            self._arrived.notify()
        try:
            return await request.future
        except asyncio.CancelledError:
            self._cancel(request)
            raise

    def _shed(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.observe_shed(reason)

    def close(self) -> None:
        """Stop both threads; requests not finished fail with BackendClosedError. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._arrived.notify_all()
            self._pooled.notify_all()
        self.set_device_work(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=30)
        error = BackendClosedError(f"{self.name} was shut down before this request finished")
        with self._lock:
            pending = {id(r): r for r in self._incoming}
            pending.update((id(s.request), s.request) for s in self._pool)
            self._incoming.clear()
            self._pool.clear()
            self._seeds.clear()
            self._queued = 0
        self._deliver([(r, error) for r in pending.values()])

    # ---- tokenizer thread -------------------------------------------------------------------
    def _tokenize_loop(self) -> None:
        while True:
            with self._lock:
                while not self._incoming and not self._closed:
                    self._arrived.wait()
                if self._closed:
                    return
                requests = [r for r in self._incoming if not r.cancelled]
                self._incoming.clear()
            if not requests:
                continue
            tokenized = self._tokenize(requests)
            refused: list[tuple[PendingRequest[P, R], BaseException]] = []
            with self._lock:
                for request, items in zip(requests, tokenized, strict=True):
                    if request.cancelled or isinstance(items, BaseException):
                        # Cancelled while being tokenized: _cancel found nothing to return.
                        self._queued -= request.size
                        if isinstance(items, BaseException):
                            refused.append((request, items))
                        continue
                    request.results = [None] * len(items)
                    request.missing = len(items)
                    for index, item in enumerate(items):
                        slot = PooledInput(request, index, item, next(self._seq))
                        bisect.insort(self._pool, slot, key=pool_order)
                        self._seeds.append(slot, request.priority)
                self._pooled.notify_all()
            self._deliver(refused)

    def _tokenize(self, requests: list[PendingRequest[P, R]]) -> list[list[I] | BaseException]:
        """The stages' tokenize over these requests at once. If that raises (rather than
        refusing a payload), each request is tokenized alone, so that only the one that breaks
        the tokenizer fails; the thread itself never dies of it."""
        try:
            tokenized = self.stages.tokenize([r.payload for r in requests])
            for request, items in zip(requests, tokenized, strict=True):
                if isinstance(items, list) and len(items) != request.size:
                    raise RuntimeError(f"tokenize gave {len(items)} inputs for {request.size}")
            return tokenized
        except Exception as e:
            if len(requests) > 1:
                return [self._tokenize([r])[0] for r in requests]
            log.exception("%s: tokenizing a request failed", self.name)
            return [e]

    # ---- forward thread ---------------------------------------------------------------------
    def _forward_loop(self) -> None:
        if self._on_worker_start is not None:
            self._on_worker_start()
        while True:
            with self._lock:
                batch = self._next_batch()
                if batch is None:
                    return
            self._run(batch)

    def _next_batch(self) -> list[PooledInput[I]] | None:
        """Wait for inputs (holding the condition's lock), then take one batch from the pool."""
        while True:
            while not self._seeds and not self._closed:
                self._pooled.wait()
            if self._closed:
                return None
            oldest = self._seeds.seed()
            if oldest is None:
                continue
            deadline = oldest.request.submitted_at + self.limits.batch_wait_s
            target = min(self._last_batch_size, self.limits.max_batch_size)
            now = time.perf_counter()
            # Wait for a fuller batch only while more is plausibly on its way: inputs still
            # being tokenized, or fewer pooled than the previous batch held.
            if now < deadline and (self._incoming or len(self._pool) < target):
                self._pooled.wait(deadline - now)
                continue
            return self._take_batch(oldest)

    def _take_batch(self, oldest: PooledInput[I]) -> list[PooledInput[I]]:
        """Grow a batch around `oldest` in length order while a neighbour costs less in it
        than in a pass of its own, under the token and size budgets."""
        pool = self._pool
        lo = bisect.bisect_left(pool, oldest.key, key=pool_order)
        hi = lo + 1  # the batch is pool[lo:hi]
        longest = oldest.item.length
        real = max(1, longest)
        overhead = self.limits.batch_overhead_tokens
        max_tokens, max_size = self.limits.max_batch_tokens, self.limits.max_batch_size
        unpadded = self.limits.unpadded
        while hi - lo < max_size:
            size = hi - lo + 1
            now = real if unpadded else (size - 1) * longest
            # What a neighbour adds to the batch's tokens (a shorter one, left, is padded up
            # to `longest`; a longer one, right, pads every input already in the batch up to
            # its own length) less what it would cost in a pass of its own: worth taking
            # while that is not positive. Unpadded, a batch costs its real tokens, so it
            # grows to its budgets.
            left = right = float("inf")
            if lo > 0:
                left_len = pool[lo - 1].item.length
                tokens = real + left_len if unpadded else size * longest
                if tokens <= max_tokens:
                    left = tokens - now - (overhead + left_len)
            right_len = pool[hi].item.length if hi < len(pool) else 0
            if hi < len(pool):
                tokens = real + right_len if unpadded else size * right_len
                if tokens <= max_tokens:
                    right = tokens - now - (overhead + right_len)
            if min(left, right) > 0:
                break  # any neighbour costs more here than in a pass of its own
            if left <= right:
                lo -= 1
                real += pool[lo].item.length
            else:
                hi += 1
                real += right_len
                longest = right_len
        batch = pool[lo:hi]
        del pool[lo:hi]
        for slot in batch:
            slot.taken = True
        self._queued -= len(batch)
        self._last_batch_size = len(batch)
        self._seeds.batch_taken()
        self.work.started(id(batch), len(batch))
        return batch

    def _run(self, batch: list[PooledInput[I]]) -> None:
        start = time.perf_counter()
        for slot in batch:
            if slot.request.started_at is None:
                slot.request.started_at = start
        try:
            results = self.stages.forward([s.item for s in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"forward gave {len(results)} results for {len(batch)} inputs")
        except Exception as e:
            log.exception("%s: forward pass over %d inputs failed", self.name, len(batch))
            with self._lock:
                self.work.finished(id(batch))
            self._fail_requests({id(s.request): s.request for s in batch}.values(), e)
            return
        end = time.perf_counter()
        with self._lock:
            self.work.finished(id(batch))
            self.admission.observe(len(batch), end - start)
        done: list[tuple[PendingRequest[P, R], list[R] | BaseException]] = []
        for slot, result in zip(batch, results, strict=True):
            request = slot.request
            if request.failed or request.cancelled:
                continue
            request.results[slot.index] = result
            request.missing -= 1
            if request.missing == 0:
                done.append((request, request.results))  # type: ignore[arg-type]  # all set
        if self._metrics is not None:
            lengths = [s.item.length for s in batch]
            self._metrics.observe_batch(
                lengths, end - start, self._queued, unpadded=self.limits.unpadded
            )
            for request, _ in done:
                started = request.started_at if request.started_at is not None else start
                self._metrics.observe_request(started - request.submitted_at,
                                              end - request.submitted_at)  # fmt: skip
        self._deliver(done)

    def _fail_requests(self, requests: Any, error: BaseException) -> None:
        failed = []
        with self._lock:
            for request in requests:
                if request.failed or request.cancelled:
                    continue
                request.failed = True
                failed.append(request)
            self._drop_slots(lambda s: s.request.failed)
        self._deliver([(r, error) for r in failed])

    def _cancel(self, request: PendingRequest[P, R]) -> None:
        with self._lock:
            if request.cancelled:
                return
            request.cancelled = True
            if request in self._incoming:
                self._incoming.remove(request)
                self._queued -= request.size
                return
            self._drop_slots(lambda s: s.request is request)

    def _drop_slots(self, dead: Callable[[PooledInput[I]], bool]) -> None:
        """Remove pooled slots of requests that will never use their results (lock held)."""
        kept = []
        for slot in self._pool:
            if dead(slot):
                slot.taken = True
                self._queued -= 1
            else:
                kept.append(slot)
        self._pool[:] = kept

    def _deliver(self, outcomes: Sequence[tuple[PendingRequest[P, R], Any]]) -> None:
        """Resolve futures on their event loops: one thread-safe call per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[PendingRequest[P, R], Any]]] = {}
        for request, outcome in outcomes:
            by_loop.setdefault(request.loop, []).append((request, outcome))
        for loop, items in by_loop.items():
            # A closed loop raises RuntimeError: nobody is waiting for these results any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, items)


def _resolve(outcomes: list[tuple[PendingRequest[Any, Any], Any]]) -> None:
    for request, outcome in outcomes:
        if request.future.done():
            continue
        if isinstance(outcome, BaseException):
            request.future.set_exception(outcome)
        else:
            request.future.set_result(outcome)
