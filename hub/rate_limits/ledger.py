"""What rate-limited keys consumed, per time slot, on this replica and on the others; and the
token buckets computed from it.

A limit of C per period P is a token bucket of capacity C refilled at C/P a second. The
bucket is not kept as a level: it is computed from the consumption of the last period, in
`SLOTS` slots a period (1 s for the per-minute limits, 24 min for the per-day one), replayed
in order (a slot's consumption is taken at its start, then the slot's refill). So the other
replicas' consumption, read from SQL every sync interval (hub.rate_limits.sync), is
simply added slot by slot to this replica's own, and the bucket is the fleet's. The replay
is exact while a bucket is being drawn down; it admits at most one slot's refill (a
sixtieth of the limit) more when consumption arrives after the bucket filled up again.

Touched on the event loop only; the sync hands over what to write (`taken`) and what it read
(`apply`), never blocking.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from registry.rate_limits import SlotSpend

# Slots a limit's period is cut into.
SLOTS = 60
MINUTE, DAY = 60, 86400
# The slot lengths, in seconds, of the per-minute and the per-day series.
MINUTE_SPAN, DAY_SPAN = MINUTE // SLOTS, DAY // SLOTS
PERIOD_OF_SPAN = {MINUTE_SPAN: MINUTE, DAY_SPAN: DAY}
# What a slot counts (index into its counts).
REQUESTS, TOKENS = 0, 1


class Series:
    """One key's consumption in slots of `span` seconds: this replica's (`mine`, every slot
    it spent in since the last write marked `dirty`) and the other replicas' as of the last
    sync (`others`), each {slot index since the epoch: [requests, tokens]}."""

    def __init__(self, span: int) -> None:
        self.span = span
        self.period = PERIOD_OF_SPAN[span]
        self.mine: dict[int, list[int]] = {}
        self.others: dict[int, list[int]] = {}
        self.dirty: set[int] = set()
        # (count, refill per second) -> (slot, the bucket's debt when that slot began).
        self._starts: dict[tuple[int, float], tuple[int, float]] = {}

    def spend(self, now: float, requests: int, tokens: int) -> None:
        """Count what this replica admitted (or, negative, gave back) at `now`."""
        slot = int(now // self.span)
        counts = self.mine.get(slot)
        if counts is None:
            counts = self.mine[slot] = [0, 0]
        counts[REQUESTS] += requests
        counts[TOKENS] += tokens
        self.dirty.add(slot)

    def debt(self, count: int, capacity: float, now: float) -> float:
        """How much the fleet's bucket of `capacity` over this series' period lacks at `now`
        (0: full): the consumption of the last period minus its refill, slot by slot."""
        rate = capacity / self.period
        slot = int(now // self.span)
        start = self._starts.get((count, rate))
        if start is None or start[0] != slot:
            debt, refill = 0.0, rate * self.span
            for past in range(slot - SLOTS, slot):
                debt = max(0.0, debt + self._spent(past, count) - refill)
            self._starts[(count, rate)] = start = (slot, debt)
        elapsed = now - slot * self.span
        return max(0.0, start[1] + self._spent(slot, count) - rate * elapsed)

    def _spent(self, slot: int, count: int) -> int:
        mine, others = self.mine.get(slot), self.others.get(slot)
        return (mine[count] if mine else 0) + (others[count] if others else 0)

    def replace_others(self, others: dict[int, list[int]]) -> None:
        self.others = others
        self._starts.clear()

    def prune(self, now: float) -> None:
        """Forget the slots older than a period (still dirty ones too: they expired)."""
        oldest = int(now // self.span) - SLOTS
        for slot in [s for s in self.mine if s < oldest]:
            del self.mine[slot]
            self.dirty.discard(slot)
        for slot in [s for s in self.others if s < oldest]:
            del self.others[slot]

    @property
    def idle(self) -> bool:
        return not self.mine and not self.others


@dataclass
class KeySpend:
    """One key's consumption: requests and tokens in per-minute slots, tokens (and
    requests) in per-day slots."""

    minute: Series = field(default_factory=lambda: Series(MINUTE_SPAN))
    day: Series = field(default_factory=lambda: Series(DAY_SPAN))

    def spend(self, now: float, requests: int, tokens: int) -> None:
        self.minute.spend(now, requests, tokens)
        self.day.spend(now, requests, tokens)

    def series(self) -> tuple[Series, Series]:
        return self.minute, self.day


class Ledger:
    """Every rate-limited scope's consumption (a key's, or a key's on one model, each under
    its ledger name: hub.rate_limits.scopes), this replica's and the fleet's.

    Contract: `key(name)` is a scope's `KeySpend` (made on first use); `taken()` hands the
    sync this replica's cumulative counts of every slot spent in since the last write and
    marks them clean, `untaken(spends)` marks them dirty again after a failed write (they
    are cumulative: the next write repeats them); `apply(spends)` replaces what the other
    replicas consumed with what was read; `prune(now)` forgets slots older than a period
    and keys with nothing left in one."""

    def __init__(self) -> None:
        self.keys: dict[str, KeySpend] = {}

    def key(self, name: str) -> KeySpend:
        spend = self.keys.get(name)
        if spend is None:
            spend = self.keys[name] = KeySpend()
        return spend

    def taken(self) -> list[SlotSpend]:
        out = []
        for name, spend in self.keys.items():
            for series in spend.series():
                for slot in sorted(series.dirty):
                    requests, tokens = series.mine[slot]
                    expires = (slot + 1) * series.span + series.period
                    out.append(SlotSpend(name, series.span, slot, requests, tokens, expires))
                series.dirty.clear()
        return out

    def untaken(self, spends: Iterable[SlotSpend]) -> None:
        for s in spends:
            spend = self.keys.get(s.key)
            if spend is None:
                continue
            for series in spend.series():
                if series.span == s.span and s.slot in series.mine:
                    series.dirty.add(s.slot)

    def apply(self, spends: Iterable[SlotSpend]) -> None:
        fleet: dict[tuple[str, int], dict[int, list[int]]] = {}
        for s in spends:
            if s.span in PERIOD_OF_SPAN:
                fleet.setdefault((s.key, s.span), {})[s.slot] = [s.requests, s.tokens]
        for name in {name for name, _ in fleet}:
            self.key(name)
        for name, spend in self.keys.items():
            for series in spend.series():
                series.replace_others(fleet.get((name, series.span), {}))

    def prune(self, now: float, busy: set[str] | frozenset[str] = frozenset()) -> None:
        """Forget old slots, and keys with none left unless `busy` names them."""
        for name in list(self.keys):
            spend = self.keys[name]
            for series in spend.series():
                series.prune(now)
            if name not in busy and all(s.idle for s in spend.series()):
                del self.keys[name]
