"""One canary analyst at a time: the lease a replica holds while it analyses a canary.

Before it looks at a running canary, the controller of every replica asks for the canary's
lease (`canary:<model>` in `hub_leases`, registry.leases); the one that holds it analyses,
advances, rolls back or runs the final validation gate, and the others stand by. The holder
renews the lease at every tick and, during a long step such as the validation gate, every
third of its length (`keep`). A replica that dies stops renewing: once the lease has expired
another replica takes it and continues the canary from the step recorded in SQL. A clean
shutdown releases the leases, so a peer takes over at its next tick. A database that does
not answer counts as "not held": nobody acts on a canary it cannot record anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from hub.periodic import cancel_and_wait
from hub.sql_worker import SqlWorker, failure_reason
from hub.traffic.metrics import TrafficMetrics
from registry.leases import LeaseBook

log = logging.getLogger(__name__)


def lease_name(model: str) -> str:
    return f"canary:{model}"


class AnalystLease:
    """Take, renew and release canary leases for this replica (`holder`)."""

    def __init__(
        self,
        book: LeaseBook,
        sql: SqlWorker,
        metrics: TrafficMetrics,
        *,
        holder: str,
        ttl: float,
    ) -> None:
        self.book = book
        self.sql = sql
        self.metrics = metrics
        self.holder = holder
        self.ttl = ttl
        self._held: set[str] = set()

    async def hold(self, model: str) -> bool:
        """Take or renew the lease of `model`'s canary; False when another replica holds it
        or the database did not answer."""
        name, holder, ttl = lease_name(model), self.holder, self.ttl
        try:
            held = await self.sql.call(lambda: self.book.acquire(name, holder, ttl))
        except Exception as e:
            self.metrics.canary_leases.labels(model, "failed").inc()
            log.warning("canary of %s: could not take its lease (%s); standing by", model,
                        failure_reason(e, "traffic.sql_timeout"))  # fmt: skip
            held = False
        else:
            self.metrics.canary_leases.labels(model, "held" if held else "standby").inc()
        if held and model not in self._held:
            log.info("this replica (%s) now analyses the canary of %s", holder, model)
        (self._held.add if held else self._held.discard)(model)
        return held

    @contextlib.asynccontextmanager
    async def keep(self, model: str) -> AsyncIterator[None]:
        """Renew the lease every third of its length while the body runs."""

        async def renew() -> None:
            while True:
                await asyncio.sleep(self.ttl / 3)
                await self.hold(model)

        task = asyncio.create_task(renew(), name=f"canary lease {model}")
        try:
            yield
        finally:
            await cancel_and_wait(task)

    async def release(self, model: str) -> None:
        """Give the lease up (the canary ended, or this replica stops)."""
        self._held.discard(model)
        name, holder = lease_name(model), self.holder
        try:
            await self.sql.call(lambda: self.book.release(name, holder))
        except Exception as e:  # it expires by itself
            log.warning(
                "canary of %s: could not release its lease (%s)",
                model,
                failure_reason(e, "traffic.sql_timeout"),
            )

    async def release_all(self) -> None:
        for model in sorted(self._held):
            await self.release(model)
