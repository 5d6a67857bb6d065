"""Models the HTTP edge refuses at once: those whose queue is over its bound for a while yet.

When admission control refuses a request for its queue time (backends/admission.py), the
backend also says how long the queue needs, at least, to drain back to its bound
(`CapacityError.saturated_s`: arrivals only add to it). Any request for the same version
before then is refused the same way, but only after the hub has received, parsed, validated
and routed it: under a burst of hundreds, that work on the event loop is what the admitted
requests' answers wait behind. `Saturation` remembers the refusal, under the model name a
caller sends, so the edge (hub/api/edge.py) answers those requests with the same 503 and
`Retry-After` before any of that.

Only a bare model name whose route is fixed is remembered: not a version named with `@`, not
a version a traffic split picked (the next request could land on another), and only while
the registry snapshot the route came from is still the catalog's (a promotion or a new split
changes where the name goes). Touched only on the event loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from backends.errors import CapacityError


@dataclass(frozen=True)
class Saturated:
    """A model name's version refusing requests until `until` (the clock's time)."""

    model: str
    version: int
    kind: str  # the model's kind ("embedder", "reranker", "llm")
    until: float
    retry_after: float
    message: str
    snapshot: object  # the catalog snapshot its route was made from


class Saturation:
    """Refusals for queue time, remembered by model name until their queues have drained.

    `snapshot` returns the catalog's current registry snapshot (compared by identity)."""

    def __init__(
        self, snapshot: Callable[[], object], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._snapshot = snapshot
        self._clock = clock
        self._entries: dict[str, Saturated] = {}
        # The earliest `until` of the entries: none has run out before then, so the check
        # of every request prunes nothing until it comes.
        self._soonest = math.inf

    def __bool__(self) -> bool:
        """Whether any name may be refused now (cheap: checked for every request)."""
        if not self._entries:
            return False
        now = self._clock()
        if now < self._soonest:
            return True
        self._entries = {name: e for name, e in self._entries.items() if e.until > now}
        self._soonest = min((e.until for e in self._entries.values()), default=math.inf)
        return bool(self._entries)

    def mark(self, name: str, version: int, kind: str, error: CapacityError) -> None:
        """Remember that requests for `name` (a `kind` model, routed to `version`, not by a
        split or a reference) are refused for `error.saturated_s` seconds from now."""
        if error.saturated_s <= 0:
            return
        entry = self._entries[name] = Saturated(
            model=name,
            version=version,
            kind=kind,
            until=self._clock() + error.saturated_s,
            retry_after=error.retry_after,
            message=str(error),
            snapshot=self._snapshot(),
        )
        self._soonest = min(self._soonest, entry.until)

    def refusal(self, name: str) -> Saturated | None:
        """The remembered refusal a request naming `name` gets now, if any."""
        entry = self._entries.get(name)
        if entry is None:
            return None
        if entry.until <= self._clock() or entry.snapshot is not self._snapshot():
            del self._entries[name]
            return None
        return entry
