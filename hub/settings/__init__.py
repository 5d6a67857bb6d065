"""Hub settings: a YAML file plus `HUB_` environment overrides, read once at start.

`load_settings(path)` is the only reader. An unknown key or a bad value raises
`SettingsError` with one line per problem naming the key and where it came from (the file or
the environment variable); the CLI prints it and exits with code 2. Nothing below `hub/` reads
the environment: subsystems receive these frozen objects.

`loader` holds `HubSettings` (the whole file) and its reader, `sections` the sections and
value types it is made of, `replica` the scale-out section.
"""

from hub.settings.loader import (
    CLIENT_ENV,
    CONFIG_ENV,
    ENV_PREFIX,
    HubSettings,
    SettingsError,
    load_settings,
)
from hub.settings.replica import MIN_HOP_SECRET, ReplicaSettings
from hub.settings.sections import (
    AuthSettings,
    Budget,
    ByteSize,
    DeviceSettings,
    EngineSettings,
    ManagerSettings,
    ModelSpec,
    RegistrySettings,
    Seconds,
    StructuredOutputSettings,
    TrafficSettings,
    UsageSettings,
)

__all__ = [
    "CLIENT_ENV",
    "CONFIG_ENV",
    "ENV_PREFIX",
    "MIN_HOP_SECRET",
    "AuthSettings",
    "Budget",
    "ByteSize",
    "DeviceSettings",
    "EngineSettings",
    "HubSettings",
    "ManagerSettings",
    "ModelSpec",
    "RegistrySettings",
    "ReplicaSettings",
    "Seconds",
    "SettingsError",
    "StructuredOutputSettings",
    "TrafficSettings",
    "UsageSettings",
    "load_settings",
]
