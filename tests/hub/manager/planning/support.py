"""Plain stand-ins for the manager's entries, as the planner reads them."""

from __future__ import annotations

from dataclasses import dataclass

from hub.manager.planning import ModelKey, Planner
from hub.manager.residency import ModelState

MiB = 2**20


@dataclass
class Model:
    """Satisfies `planning.Occupant`; mutable so a test can change what the planner sees."""

    key: ModelKey
    state: ModelState = ModelState.LOADED
    pinned: bool = False
    in_flight: int = 0
    waiting: int = 0
    loaded_at: float | None = 0.0
    last_used: float = 0.0
    hits: int = 1
    cold_load_s: float | None = 1.0
    warm_load_s: float | None = None
    base: ModelKey | None = None


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def key(name: str) -> ModelKey:
    return ModelKey(name, 1)


def resident(planner: Planner, models: dict[ModelKey, Model], name: str, mib: int,
             device: str = "cpu", **fields: object) -> Model:  # fmt: skip
    """A model charged `mib` MiB on `device`, in `models` (the planner's occupants)."""
    model = Model(key(name), **fields)  # type: ignore[arg-type]
    models[model.key] = model
    planner.ledger.reserve(model.key, device, mib * MiB)
    return model
