"""The last known state of the hub's dependencies, kept by a background check.

Probes must never block on a dependency (a probe that waits on MLflow times out, and the
thread it started kept retrying for minutes). So a loop checks the database and MLflow every
`interval` seconds, one check per dependency in flight at a time on a thread of its own, and
keeps what it saw; `/health/ready`, `hub_dependency_up` and the dashboard read that state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Gauge

from hub.dependencies.calls import BoundedCalls
from hub.dependencies.devices import DeviceMonitor
from hub.periodic import cancel_and_wait

log = logging.getLogger(__name__)

Listener = Callable[[str, bool], None]


def _reason(e: BaseException) -> str:
    """A short reason for the readiness body, which anyone may read: the exception classes
    of the cause chain, never their text (hosts, ports, SQL). The log has the text."""
    names: list[str] = []
    link: BaseException | None = e
    while link is not None and len(names) < 4:
        if type(link).__name__ not in names:
            names.append(type(link).__name__)
        link = link.__cause__ or link.__context__
    return " <- ".join(names)


def _root_text(e: BaseException) -> str:
    """The text of the innermost cause (the refused connection, the read timeout): for the
    log, where the outage is reported once when it starts."""
    link = e
    for _ in range(16):  # a chain, not a cycle: bounded
        inner = link.__cause__ or link.__context__
        if inner is None:
            break
        link = inner
    return str(link).splitlines()[0][:300] if str(link) else type(link).__name__


@dataclass(frozen=True)
class DependencyState:
    """What the last check of one dependency saw. `up` is None before the first check."""

    name: str
    up: bool | None = None
    # Why the last check failed: exception class names only (see `_reason`).
    error: str | None = None
    # Wall-clock time (epoch seconds) `up` last changed, and monotonic time of the last
    # answer; None when it never answered.
    since: float | None = None
    last_ok: float | None = None

    def fresh(self, within: float, now: float | None = None) -> bool:
        """Whether it answered within the last `within` seconds."""
        if self.last_ok is None:
            return False
        return (now if now is not None else time.monotonic()) - self.last_ok <= within

    def report(self) -> dict[str, object]:
        """The JSON readiness and the dashboard show."""
        out: dict[str, object] = {"up": self.up}
        if self.since is not None:
            out["since"] = self.since
        if self.last_ok is not None:
            out["last_ok_seconds_ago"] = round(time.monotonic() - self.last_ok, 1)
        if self.error is not None:
            out["error"] = self.error
        return out


class DependencyMonitor:
    """Checks each dependency in the background and keeps its last state.

    Contract: `checks` maps a name to a blocking call that raises unless the dependency
    answers. `check_now()` runs every check once and returns when all finished (start-up);
    `start()` repeats them every `interval` seconds until `stop()`. A check still running
    when the next is due is not started again (no thread piles up), and one outliving
    `timeout` counts as down, except the first check of a dependency in
    `created_on_first_use`: a local store its first use creates (embedded MLflow importing
    and migrating its SQLite database, tens of seconds on a first start) cannot be
    unreachable, so that check is awaited whole and `up` stays None meanwhile.
    `state(name)` never blocks. Listeners hear (name, up) on every change of `up`, on the
    event loop.
    `devices`, when given, probes the accelerators on the same schedule
    (`hub.dependencies.devices`); it is started and stopped with these.
    """

    def __init__(
        self,
        checks: Mapping[str, Callable[[], None]],
        *,
        interval: float,
        timeout: float,
        created_on_first_use: Collection[str] = (),
        metrics_registry: CollectorRegistry | None = None,
        devices: DeviceMonitor | None = None,
    ) -> None:
        self.interval = interval
        self.devices = devices
        self._checks = dict(checks)
        self._created_on_first_use = frozenset(created_on_first_use)
        self._calls = {
            name: BoundedCalls(f"{name} check", workers=1, deadline=timeout) for name in checks
        }
        self._states = {name: DependencyState(name) for name in checks}
        self._listeners: list[Listener] = []
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._up = Gauge(
            "hub_dependency_up",
            "Whether the dependency answered its last background check (1) or not (0): "
            "database (readiness needs it), mlflow (reported only)",
            ["dependency"],
            registry=metrics_registry,
        )

    def state(self, name: str) -> DependencyState:
        return self._states[name]

    def states(self) -> dict[str, DependencyState]:
        return dict(self._states)

    def on_change(self, listener: Listener) -> None:
        self._listeners.append(listener)

    async def check_now(self) -> None:
        device_checks = [self.devices.check_now()] if self.devices is not None else []
        await asyncio.gather(*(self._check(name) for name in self._checks), *device_checks)

    def start(self) -> None:
        if self.devices is not None:
            self.devices.start()
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="dependency checks")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        for calls in self._calls.values():
            calls.close()
        if self.devices is not None:
            await self.devices.stop()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            # Each in its own task: a slow MLflow never delays the database's check.
            for name in self._checks:
                if self._calls[name].busy == 0:
                    task = asyncio.create_task(self._check(name), name=f"check {name}")
                    self._running.add(task)
                    task.add_done_callback(self._running.discard)

    async def _check(self, name: str) -> None:
        creating = name in self._created_on_first_use and self._states[name].up is None
        try:
            await self._calls[name].run(self._checks[name], deadline=None if creating else True)
        except Exception as e:
            self._record(name, False, _reason(e), detail=_root_text(e))
        else:
            self._record(name, True, None)

    def _record(self, name: str, up: bool, error: str | None, detail: str = "") -> None:
        was = self._states[name]
        now = time.monotonic()
        changed = was.up != up
        self._states[name] = DependencyState(
            name,
            up=up,
            error=error,
            since=time.time() if changed else was.since,
            last_ok=now if up else was.last_ok,
        )
        self._up.labels(name).set(1 if up else 0)
        if not changed:
            return
        if up:
            if was.up is not None:
                log.info("%s answers again", name)
        else:
            log.warning("%s is unreachable (%s): %s", name, error, detail)
        for listener in self._listeners:
            try:
                listener(name, up)
            except Exception:
                log.exception("dependency listener failed")
