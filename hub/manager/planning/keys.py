"""The name every part of the manager uses for one model version."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class ModelKey:
    """One registered model version: `name@version`; hashable and ordered (status rows and
    tie-breaks sort by it)."""

    name: str
    version: int

    def __str__(self) -> str:
        return f"{self.name}@{self.version}"
