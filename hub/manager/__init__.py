"""The model manager: the only way from a request to a loaded backend."""

from hub.manager.devices import Device
from hub.manager.loader import VersionLoader
from hub.manager.manager import ModelManager
from hub.manager.state import (
    DeviceStatus,
    HostTierStatus,
    ModelKey,
    ModelState,
    ModelStatus,
)

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
