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

from hub.settings import ModelSpec
from hub.units import parse_duration


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
        runtime_config: Mapping[str, Any],
        spec: ModelSpec | None,
        devices: Collection[str],
    ) -> Deployment:
        device = spec.device if spec is not None else None
        keep_alive = spec.keep_alive if spec is not None else None
        pin = False
        if runtime_config.get("device") is not None:
            device = str(runtime_config["device"])
        if runtime_config.get("keep_alive") is not None:
            try:
                keep_alive = parse_duration(runtime_config["keep_alive"])
            except ValueError as e:
                raise DeploymentError(f"runtime config keep_alive: {e}") from None
        if "pin" in runtime_config:
            if not isinstance(runtime_config["pin"], bool):
                raise DeploymentError(
                    f"runtime config pin must be true or false, not {runtime_config['pin']!r}"
                )
            pin = runtime_config["pin"]
        if device is not None and device not in devices:
            raise DeploymentError(
                f"the model asks for device {device!r}, which is not configured "
                f"(devices: {', '.join(devices)})"
            )
        return cls(device=device, keep_alive=keep_alive, pin=pin)
