"""How one model version is run: on which device, how long it stays idle, whether pinned.

Three layers, the later winning: the manager's defaults (`manager.keep_alive`), the model's
entry in the settings' `models:` list (`keep_alive`, `device`; by name, so every version),
and the version's registered runtime config (`keep_alive`, `device`, `pin`). A request's own
`keep_alive` then overrides the keep-alive until the next request (Ollama's meaning).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from backends.runtime_config import RuntimeConfig, RuntimeConfigError
from hub.settings import ModelSpec


class DeploymentError(ValueError):
    """A runtime config that cannot be applied; the message names the key."""


@dataclass(frozen=True)
class Deployment:
    # The device it must go to; None lets placement choose.
    device: str | None = None
    # Seconds it stays resident once idle; -1 forever, 0 unload after each request; None:
    # the manager's default.
    keep_alive: float | None = None
    # Pinned whenever it is loaded: never evicted.
    pin: bool = False

    @classmethod
    def resolve(
        cls,
        runtime_config: RuntimeConfig | Mapping[str, Any],
        spec: ModelSpec | None,
        devices: Collection[str],
    ) -> Deployment:
        """The version's deployment: its runtime config's `device`, `keep_alive` and `pin`
        over the model entry's; a mapping is read for those keys alone (other kinds' keys
        are the backend's). DeploymentError naming the key for a value that does not check,
        or a device that is not configured."""
        config = _deployment_keys(runtime_config)
        device = spec.device if spec is not None else None
        keep_alive = spec.keep_alive if spec is not None else None
        if config.device is not None:
            device = config.device
        if config.keep_alive is not None:
            keep_alive = config.keep_alive
        if device is not None and device not in devices:
            raise DeploymentError(
                f"the model asks for device {device!r}, which is not configured "
                f"(devices: {', '.join(devices)})"
            )
        return cls(device=device, keep_alive=keep_alive, pin=config.pin)


def _deployment_keys(runtime_config: RuntimeConfig | Mapping[str, Any]) -> RuntimeConfig:
    if isinstance(runtime_config, RuntimeConfig):
        return runtime_config
    shared = {k: v for k, v in runtime_config.items() if k in RuntimeConfig.model_fields}
    try:
        return RuntimeConfig.parse(shared)
    except RuntimeConfigError as e:
        raise DeploymentError(str(e)) from None
