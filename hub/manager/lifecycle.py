"""The blocking work of residency, behind one small protocol.

The manager decides on the event loop and does the slow parts through a `Lifecycle`, each
call in a worker thread: `prepare` (look up and materialise a version), `predict` (its
footprint per device), `load`, `attach` (a LoRA adapter onto its loaded base) and `restore`
(each returning the measured footprint), `park`
(offload to host memory) and `unload` (free it for good). `BackendLifecycle` is the real one:
a `VersionLoader` for the versions and `Footprint` for the measurements around each
`Backend` call. Tests pass a fake lifecycle to drive the manager without torch or a registry.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from hub.manager.planning.keys import ModelKey
from hub.units import format_bytes

if TYPE_CHECKING:
    from backends.base import Backend
    from hub.manager.footprint import Footprint
    from hub.manager.loader import PreparedVersion, VersionLoader

log = logging.getLogger(__name__)

# A prediction further than this from the measurement is logged.
PREDICTION_TOLERANCE = 0.10


class Lifecycle(Protocol):
    """Blocking steps the manager runs in worker threads; none touches manager state."""

    def prepare(self, key: ModelKey) -> PreparedVersion:
        """Look the version up and make its files available locally."""

    def predict(self, prepared: PreparedVersion, budgets: Mapping[str, int]) -> dict[str, int]:
        """Predicted bytes on each device of `budgets` (device -> budget bytes)."""

    def load(self, prepared: PreparedVersion, device: str, budget: int) -> tuple[Backend, int]:
        """Load onto `device`; returns the backend and its measured bytes."""

    def attach(self, prepared: PreparedVersion, base: Backend, device: str) -> tuple[Backend, int]:
        """Attach a LoRA adapter to its loaded `base` on `device`; returns the adapter's
        backend and its measured bytes."""

    def restore(self, backend: Backend, device: str) -> int:
        """Bring parked weights back onto `device`; returns the measured bytes."""

    def park(self, backend: Backend, device: str) -> None:
        """Offload `backend`'s weights from `device` into host memory."""

    def unload(self, backend: Backend, device: str | None, measured: int) -> None:
        """Free `backend` for good (`device` None: its weights are parked in host memory)."""


class BackendLifecycle:
    """The real lifecycle: versions from a `VersionLoader`, each step measured by
    `Footprint`."""

    def __init__(self, loader: VersionLoader, footprint: Footprint) -> None:
        self.loader = loader
        self.footprint = footprint

    def prepare(self, key: ModelKey) -> PreparedVersion:
        return self.loader.prepare(key)

    def predict(self, prepared: PreparedVersion, budgets: Mapping[str, int]) -> dict[str, int]:
        return self.footprint.predict(prepared, budgets)

    def load(self, prepared: PreparedVersion, device: str, budget: int) -> tuple[Backend, int]:
        return self.footprint.load(self.loader, prepared, device, budget)

    def attach(self, prepared: PreparedVersion, base: Backend, device: str) -> tuple[Backend, int]:
        return self.footprint.attach(self.loader, prepared, base, device)

    def restore(self, backend: Backend, device: str) -> int:
        return self.footprint.restore(backend, device)

    def park(self, backend: Backend, device: str) -> None:
        self.footprint.offload(backend, device)

    def unload(self, backend: Backend, device: str | None, measured: int) -> None:
        self.footprint.dispose(backend, device, measured)


def check_prediction(what: str, predicted: int, measured: int) -> None:
    """Log a prediction off by more than 10%: a warning when the model came out larger
    (the ledger was short until it settled), information when smaller (only wasteful)."""
    if predicted <= 0 or measured <= 0:
        return
    off = (measured - predicted) / predicted
    if abs(off) > PREDICTION_TOLERANCE:
        log.log(
            logging.WARNING if off > 0 else logging.INFO,
            "%s: predicted %s, measured %s (%+.0f%%); the ledger charges the larger",
            what, format_bytes(predicted), format_bytes(measured), 100 * off,
        )  # fmt: skip
