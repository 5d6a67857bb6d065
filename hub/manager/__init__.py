"""The model manager: the only way from a request to a loaded backend.

Names are imported on first use (PEP 562), so `import hub.manager.planning` or
`hub.manager.residency` pulls in neither torch nor the settings: only the modules a caller
actually touches are loaded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hub.manager.devices import Device
    from hub.manager.loader import VersionLoader
    from hub.manager.manager import ModelManager
    from hub.manager.planning.keys import ModelKey
    from hub.manager.residency import ModelState
    from hub.manager.state import DeviceStatus, HostTierStatus, ModelStatus

_WHERE = {
    "Device": "hub.manager.devices",
    "DeviceStatus": "hub.manager.state",
    "HostTierStatus": "hub.manager.state",
    "ModelKey": "hub.manager.planning.keys",
    "ModelManager": "hub.manager.manager",
    "ModelState": "hub.manager.residency",
    "ModelStatus": "hub.manager.state",
    "VersionLoader": "hub.manager.loader",
}

__all__ = [
    "Device",
    "DeviceStatus",
    "HostTierStatus",
    "ModelKey",
    "ModelManager",
    "ModelState",
    "ModelStatus",
    "VersionLoader",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'hub.manager' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
