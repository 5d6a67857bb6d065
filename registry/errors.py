"""Registry errors; each message names what is wrong and, where it helps, what exists."""

from __future__ import annotations


class RegistryError(Exception):
    """Base class of registry errors."""


class NotFoundError(RegistryError):
    """A model, version or alias that does not exist."""


class InvalidSourceError(RegistryError):
    """A register source that cannot become a model version (missing, unsafe, wrong kind)."""


class InvalidConfigError(InvalidSourceError):
    """A runtime config the version's kind cannot use; `key` names the offending key."""

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class ConflictError(RegistryError):
    """The request contradicts the registry's current state."""


class IntegrityError(RegistryError):
    """Materialised files do not match the version's sha256 manifest."""


class InvalidTrafficError(RegistryError):
    """A traffic policy or canary that cannot be served (weights, versions, kinds, steps)."""


class DependencyUnavailable(RegistryError):
    """The database or MLflow did not answer (down, unreachable, or too slow): nothing is
    wrong with the request or the model, and retrying once the dependency is back works.
    `dependency` names it ("database" or "mlflow")."""

    def __init__(self, message: str, *, dependency: str = "registry") -> None:
        super().__init__(message)
        self.dependency = dependency
