"""What the dynamic batcher (backends.encoders.batching) moves around: the stages contract a backend
implements (`BatchStages`: tokenize payloads, run one batch forward), one submitted payload
(`PendingRequest`: where its results go, how many are missing) and one tokenized input waiting
in the pool (`PooledInput`, ordered by length then arrival)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

P = TypeVar("P")  # a request's payload, as the backend's async method received it
I = TypeVar("I", bound="Tokenized")  # noqa: E741 - one tokenized input
R = TypeVar("R")  # the model's result for one input
P_contra = TypeVar("P_contra", contravariant=True)
R_co = TypeVar("R_co", covariant=True)


class Tokenized(Protocol):
    @property
    def length(self) -> int:
        """Tokens this input takes in a batch (before padding)."""
        ...


class BatchStages(Protocol[P_contra, I, R_co]):
    """The model-specific half of batching; both methods run in the batcher's threads."""

    def tokenize(self, payloads: Sequence[P_contra]) -> list[list[I] | BaseException]:
        """For each payload its inputs, tokenized (exactly as many as it was submitted with),
        or the error that refuses it (an `InputError` naming the input)."""
        ...

    def forward(self, items: Sequence[I]) -> Sequence[R_co]:
        """Run one batch through the model: one result per item, in order."""
        ...


class PendingRequest(Generic[P, R]):
    """One submitted payload: where its results go, and how many are still missing."""

    __slots__ = ("cancelled", "failed", "future", "loop", "missing", "payload", "priority",
                 "results", "size", "started_at", "submitted_at")  # fmt: skip

    def __init__(
        self, payload: P, size: int, loop: asyncio.AbstractEventLoop, priority: int = 0
    ) -> None:
        self.payload = payload
        self.size = size
        self.loop = loop
        # The scheduling level (backends.priority): lower seeds batches first.
        self.priority = priority
        self.future: asyncio.Future[list[R]] = loop.create_future()
        self.submitted_at = time.perf_counter()
        self.started_at: float | None = None
        self.results: list[R | None] = []
        self.missing = 0
        self.cancelled = False
        self.failed = False


class PooledInput(Generic[I]):
    """One tokenized input waiting in the pool."""

    __slots__ = ("index", "item", "key", "request", "taken")

    def __init__(self, request: PendingRequest[Any, Any], index: int, item: I, seq: int) -> None:
        self.request = request
        self.index = index
        self.item = item
        self.key = (item.length, seq)  # pool order: by length, then arrival
        self.taken = False


def pool_order(slot: PooledInput[Any]) -> tuple[int, int]:
    return slot.key
