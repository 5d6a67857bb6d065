"""Shadow traffic: replay a share of requests on another version and compare the answers.

The client only ever sees the primary's answer. Once it is complete, `serve()` offers a
`MirrorJob` (the kind-specific replay, the primary's output, its latency) with `put_nowait`
on a bounded queue; a full queue drops the mirror and counts it, so a slow shadow can never
hold a request up. A few workers run the jobs: acquire the shadow version through the
manager (loading it on first use), replay, compare, and record the shadow's latency, error
and similarity in the readout and metrics.

On a CPU-only hub the shadow competes with primary requests for cores, so by default
(`traffic.shadow_when_idle`) a worker starts a job only in an idle moment of the hub (no HTTP
request in flight, up to the last byte of its response; see hub.traffic.in_flight) that is
likely to hold the whole replay: the recent idle gaps between requests are at least as long
as the shadow's recent replays, or, when requests come closer together than that, the hub has
stayed idle for a replay's length. A job that found no such moment within
`traffic.shadow_max_wait` is dropped and counted: a saturated hub sheds its shadow rather
than slowing its clients. `benchmarks/shadow_overhead.py` measures the primary's latency
with and without a shadow.

Comparisons (1.0 = identical): embeddings by mean cosine similarity, rerank scores by
Spearman rank correlation, greedy LLM output by exact match.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from backends.base import Backend
from hub.manager import ModelManager
from hub.periodic import cancel_and_wait
from hub.traffic.in_flight import InFlight
from hub.traffic.metrics import TrafficMetrics
from hub.traffic.stats import TrafficStats
from registry.views import ShadowView

log = logging.getLogger(__name__)


class Replay(Protocol):
    """How one kind replays a request on another version and compares the two answers."""

    async def run(self, backend: Backend) -> Any:
        """Serve the same request with `backend` (the shadow version's) and return its output
        in the form `compare` takes."""

    def compare(self, primary: Any, shadow: Any) -> float | None:
        """Similarity of the two outputs, 1.0 when identical; None when not comparable."""


# ---- comparators --------------------------------------------------------------------------
def mean_cosine(primary: np.ndarray, shadow: np.ndarray) -> float | None:
    """Mean cosine similarity of matching rows; None when the shapes differ (another
    dimension cannot be compared vector by vector)."""
    a = np.asarray(primary, dtype=np.float64)
    b = np.asarray(shadow, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2 or a.shape[0] == 0:
        return None
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    cosines = np.sum(a * b, axis=1) / np.where(norms == 0, 1.0, norms)
    value = float(np.mean(cosines))
    return value if math.isfinite(value) else None


def rank_correlation(primary: Sequence[float], shadow: Sequence[float]) -> float | None:
    """Spearman's rank correlation of two score lists over the same documents; None for
    fewer than two documents or constant scores (no ranking to compare)."""
    from scipy.stats import spearmanr

    if len(primary) != len(shadow) or len(primary) < 2:
        return None
    if len(set(primary)) == 1 or len(set(shadow)) == 1:
        return 1.0 if list(primary) == list(shadow) else None
    rho = float(spearmanr(primary, shadow).statistic)
    return rho if math.isfinite(rho) else None


def exact_match(primary: Any, shadow: Any) -> float:
    """1.0 when the outputs are equal (greedy decoding is deterministic), else 0.0."""
    return 1.0 if primary == shadow else 0.0


# ---- the queue ----------------------------------------------------------------------------
@dataclass
class MirrorJob:
    model: str  # the public name the primary request asked for
    shadow: ShadowView
    kind: str
    replay: Replay
    output: Any
    primary_latency_s: float
    enqueued_at: float = field(default_factory=time.monotonic)

    @property
    def label(self) -> str:
        return (
            str(self.shadow.version)
            if self.shadow.model == self.model
            else f"{self.shadow.model}@{self.shadow.version}"
        )


class ShadowMirror:
    """The bounded mirror queue and its workers. `offer` never blocks."""

    def __init__(
        self,
        manager: ModelManager,
        stats: TrafficStats,
        metrics: TrafficMetrics,
        in_flight: InFlight,
        *,
        queue_size: int,
        workers: int,
        when_idle: bool,
        max_wait: float,
    ) -> None:
        self.manager = manager
        self.stats = stats
        self.metrics = metrics
        self.in_flight = in_flight
        self.workers = workers
        self.when_idle = when_idle
        self.max_wait = max_wait
        self._queue: asyncio.Queue[MirrorJob] = asyncio.Queue(maxsize=queue_size)
        self._tasks: list[asyncio.Task[None]] = []
        # {(model, shadow label, outcome): count}; outcome: ok, error, dropped_full,
        # dropped_stale, incomparable.
        self.outcomes: Counter[tuple[str, str, str]] = Counter()
        # Recent replay durations per (model, shadow label), seconds.
        self._replays: dict[tuple[str, str], deque[float]] = {}

    def offer(self, job: MirrorJob) -> bool:
        """Queue `job`; False (and counted) if the queue is full."""
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            self._count(job, "dropped_full")
            return False
        return True

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._work(), name=f"shadow worker {i}")
                for i in range(self.workers)
            ]

    async def stop(self) -> None:
        await cancel_and_wait(*self._tasks)
        self._tasks = []

    async def drain(self) -> None:
        """Wait until every queued job has been run or dropped (tests, benchmarks)."""
        await self._queue.join()

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            try:
                await self.run(job)
            except Exception:  # one bad mirror must not stop the worker
                log.exception("shadow mirror of %s to %s failed", job.model, job.label)
            finally:
                self._queue.task_done()

    async def run(self, job: MirrorJob) -> None:
        if self.when_idle and not await self._idle_moment(job):
            self._count(job, "dropped_stale")
            return
        error: str | None = None
        output: Any = None
        start = time.perf_counter()
        try:
            async with self.manager.acquire(job.shadow.model, job.shadow.version, job.kind) as b:
                # Timed from here: a first mirror that loads the shadow version would make
                # the replay look seconds long.
                start = time.perf_counter()
                output = await job.replay.run(b)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        latency = time.perf_counter() - start
        if error is None:
            replays = self._replays.setdefault((job.model, job.label), deque(maxlen=32))
            replays.append(latency)
        similarity = None if error else job.replay.compare(job.output, output)
        self.stats.record_shadow(
            job.model,
            job.label,
            latency_s=latency,
            primary_latency_s=job.primary_latency_s,
            error=error,
            similarity=similarity,
        )
        outcome = "error" if error else ("incomparable" if similarity is None else "ok")
        self._count(job, outcome)
        self.metrics.shadow_seconds.labels(job.model, job.label).observe(latency)
        if similarity is not None:
            self.metrics.shadow_similarity.labels(job.model, job.label).observe(similarity)

    async def _idle_moment(self, job: MirrorJob) -> bool:
        """Wait for an idle moment of the hub likely to hold a whole replay; False if none
        came within `max_wait` of the mirror being queued.

        A moment is likely long enough when the recent idle gaps between requests are at
        least as long as this shadow's recent replays (or either is not known yet). When
        requests come closer together than that, a replay started at once would overlap the
        next request: it starts only once the hub has stayed idle for a replay's length."""
        deadline = job.enqueued_at + self.max_wait
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await self.in_flight.wait_idle(remaining):
                return False
            gap, replay = self.in_flight.typical_gap(), self.typical_replay(job)
            if gap is None or replay is None or gap >= replay:
                return True
            if deadline - time.monotonic() < replay:
                return False
            if not await self.in_flight.wait_busy(replay):
                return True  # idle for a replay's length: the load has eased

    def typical_replay(self, job: MirrorJob) -> float | None:
        """Median seconds of this shadow's recent replays; None before the first."""
        replays = self._replays.get((job.model, job.label))
        return statistics.median(replays) if replays else None

    def _count(self, job: MirrorJob, outcome: str) -> None:
        self.outcomes[(job.model, job.label, outcome)] += 1
        self.metrics.shadow_requests.labels(job.model, job.label, outcome).inc()
