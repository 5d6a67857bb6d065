"""The keep-alive clock: when an idle model's keep-alive runs out, it is evicted.

`arm` starts an idle, loaded model's clock (keep-alive 0: evict at once; forever or pinned:
no clock). The `Reaper` timer calls `tick`, which evicts the models whose keep-alive ran out
and, while loads wait for room, pumps the planner again when the next model passes its
minimum residency; it returns the next deadline.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from hub.manager.evicting import Evictions
from hub.manager.keep_alive import FOREVER, Reaper
from hub.manager.planning import ModelKey, Planner, idle_loaded
from hub.manager.state import Entry


class KeepAliveClock:
    """Arms keep-alives and runs the manager's one timer."""

    def __init__(
        self,
        entries: Mapping[ModelKey, Entry],
        planner: Planner,
        evictions: Evictions,
        *,
        default_keep_alive: float,
        interval: float,
    ) -> None:
        self._entries = entries
        self._planner = planner
        self._evictions = evictions
        self._default = default_keep_alive
        self.reaper = Reaper(interval, self.tick)

    def arm(self, entry: Entry) -> None:
        """Start the idle clock of a loaded, idle model (keep-alive 0: evict now)."""
        keep_alive = entry.keep_alive_s(self._default)
        entry.expires_at = None
        # A base with adapters on it stays; its clock starts when the last one leaves.
        if entry.pinned or keep_alive == FOREVER or self._planner.adapters_on(entry.key):
            return
        if keep_alive == 0:
            self._evictions.start(entry, "keep_alive")
            return
        entry.expires_at = time.monotonic() + keep_alive
        self.reaper.poke()

    def tick(self) -> float | None:
        """Evict models whose keep-alive ran out and retry waiting loads; returns when to
        look again: the next expiry, or, while loads wait for room, the next model to pass
        its minimum residency."""
        now = time.monotonic()
        next_at: float | None = None
        for entry in list(self._entries.values()):
            if entry.expires_at is None or entry.pinned or not idle_loaded(entry):
                continue
            if self._planner.adapters_on(entry.key):
                entry.expires_at = None  # re-armed when its last adapter leaves
                continue
            if entry.expires_at <= now:
                self._evictions.start(entry, "keep_alive")
            else:
                next_at = min(next_at or entry.expires_at, entry.expires_at)
        if self._planner.broker.pending:
            self._evictions.pump()
            eligible = self._planner.next_eligible()
            if eligible is not None:
                next_at = min(next_at or eligible, eligible)
        return next_at
