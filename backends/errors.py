"""Errors raised by backends, each carrying what the caller needs to act on it.

The hub maps them onto HTTP: `InputError` is the caller's mistake (400; a prompt over the
context is a `ContextLengthError`, coded `context_length_exceeded` as OpenAI codes it),
`CapacityError` means "try again later" (503 with `Retry-After`), as does `TransientError` (a
failure the backend recovered from), and `LoadError` means the model could not be brought up.
"""

from __future__ import annotations


class BackendError(Exception):
    """Base class of every error a backend raises on purpose."""

    # The version that raised it as `X-Hub-Model-Version` names it, set by the hub so the
    # error answer names the version like every other answer does.
    served_by: str | None = None


class InputError(BackendError):
    """The request cannot be served as asked (too long, wrong shape, unsupported option)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InputError):
    """The prompt, or the prompt with the tokens asked for, does not fit the model's context;
    `param` names what to shorten (the prompt) or lower (max_tokens)."""


class CapacityError(BackendError):
    """The backend is saturated (queue full); the caller should retry after `retry_after` s.
    `saturated_s`: how long any other request would be refused the same way, at least (the
    estimated queue needs that long to drain to its bound; 0 when unknown), so a layer in
    front may refuse those at once without asking again."""

    def __init__(self, message: str, *, retry_after: float = 1.0, saturated_s: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.saturated_s = saturated_s


class TransientError(BackendError):
    """This request failed for a reason that was not its own (the device or the model raised
    in a shared step) and the backend recovered: the same request may succeed if sent again
    after `retry_after` s."""

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class LoadError(BackendError):
    """A model could not be loaded: unsafe weights, missing files, unsupported architecture."""


class BackendClosedError(BackendError):
    """Work was submitted to a backend that has been unloaded or is shutting down."""
