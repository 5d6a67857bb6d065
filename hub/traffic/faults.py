"""Fault injection from the traffic policy, like a service mesh's, for testing canaries and
clients' resilience.

`faults: [{version, error_percent, delay_ms?, model?}]` in a model's policy applies to every
request of that model served by that version (routed or named directly): first the delay,
then, for `error_percent` of them, a 503 `injected fault` instead of an answer. An injected
error counts as the version's error in readouts and canary analysis, which is the point.
Mirrored shadow replays are not subject to faults.
"""

from __future__ import annotations

import asyncio
import random
import time

from hub.errors import Unavailable
from hub.routing import Route
from hub.traffic.metrics import TrafficMetrics
from registry.views import FaultView, TrafficPolicyView


class InjectedFault(Unavailable):
    """The traffic policy told this version to fail this request."""


class Timer:
    """Where request latency is measured and injected delays wait: the real clock. Tests
    swap in one whose `sleep` moves `now` forward instead of waiting
    (`TrafficService.use_timer`), so a latency fault is deterministic and costs no time."""

    def now(self) -> float:
        return time.perf_counter()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class FaultInjector:
    def __init__(
        self, metrics: TrafficMetrics, rng: random.Random | None = None, timer: Timer | None = None
    ) -> None:
        self.metrics = metrics
        self.rng = rng or random.Random()
        self.timer = timer or Timer()

    @staticmethod
    def fault_for(policy: TrafficPolicyView | None, route: Route) -> FaultView | None:
        if policy is None or not policy.faults:
            return None
        for fault in policy.faults:
            if fault.model == route.name and fault.version == route.version:
                return fault
        return None

    async def apply(self, policy: TrafficPolicyView | None, route: Route) -> None:
        """Delay and/or fail this request as the policy says; nothing without a fault."""
        fault = self.fault_for(policy, route)
        if fault is None:
            return
        public = route.public_name
        if fault.delay_ms > 0:
            self.metrics.injected_faults.labels(public, route.label, "delay").inc()
            await self.timer.sleep(fault.delay_ms / 1000)
        if fault.error_percent > 0 and self.rng.random() * 100 < fault.error_percent:
            self.metrics.injected_faults.labels(public, route.label, "error").inc()
            raise InjectedFault(
                f"injected fault: {public} {route.name} v{route.version} answers 503 for "
                f"{fault.error_percent:g}% of requests (traffic policy of {public}; "
                f"remove it with `hub traffic set` or `hub traffic clear {public}`)",
                retry_after=1.0,
                code="injected_fault",
            )
