"""A request's outcome, decided once: the HTTP status, OpenAI error type and code of an
exception.

`status_of(e)` is the one table both the error answers (hub.api.errors) and the request
metrics (`hub_requests_total`, counted by hub.serving) read, so the same exception is
always the same status in both. Classes are looked up along the exception's MRO, so a
subclass of a mapped error (a registry error subclass, a new backend error) gets its parent's
status rather than falling through to 500.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import NamedTuple

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from backends.errors import (
    BackendClosedError,
    BackendError,
    CapacityError,
    ContextLengthError,
    InputError,
    LoadError,
    TransientError,
)
from hub.errors import HubError
from registry.errors import (
    ConflictError,
    DependencyUnavailable,
    IntegrityError,
    InvalidConfigError,
    InvalidSourceError,
    InvalidTrafficError,
    NotFoundError,
    RegistryError,
)
from registry.outage import dependency_down

# nginx's "client closed request": the client left before its answer was ready.
CLIENT_CLOSED = 499


class Outcome(NamedTuple):
    status: int
    error_type: str
    code: str | None = None


class ClientGone(Exception):
    """The client disconnected before its answer was ready; nobody will read a response."""


def _hub(e: BaseException) -> Outcome:
    assert isinstance(e, HubError)
    return Outcome(e.status_code, e.error_type, e.code)


def _http(e: BaseException) -> Outcome:
    assert isinstance(e, StarletteHTTPException)
    return Outcome(e.status_code, _INVALID if e.status_code < 500 else "server_error")


_INVALID = "invalid_request_error"
_UNAVAILABLE = "service_unavailable"
# The database or MLflow did not answer: the request was fine, retry once it is back.
DEPENDENCY_DOWN = Outcome(503, _UNAVAILABLE, "dependency_unavailable")

# Most specific first does not matter: the lookup walks the exception's MRO.
_TABLE: dict[type[BaseException], Outcome | Callable[[BaseException], Outcome]] = {
    HubError: _hub,
    StarletteHTTPException: _http,
    # 400 as OpenAI and vLLM answer it, so SDKs raise their BadRequestError.
    RequestValidationError: Outcome(400, _INVALID),
    ClientGone: Outcome(CLIENT_CLOSED, "client_closed_request"),
    asyncio.CancelledError: Outcome(CLIENT_CLOSED, "client_closed_request"),
    # Backends
    # OpenAI's code for a prompt (with max_tokens) over the context; clients branch on it.
    ContextLengthError: Outcome(400, _INVALID, "context_length_exceeded"),
    InputError: Outcome(400, _INVALID),
    CapacityError: Outcome(503, _UNAVAILABLE),
    BackendClosedError: Outcome(503, _UNAVAILABLE),
    LoadError: Outcome(503, _UNAVAILABLE),
    # A failed engine step nobody's input explains: the engine recovers, so retry later.
    TransientError: Outcome(503, _UNAVAILABLE),
    BackendError: Outcome(500, "server_error"),
    # The registry
    # As the hub's own NotFound (an unknown model): every 404 is one type.
    NotFoundError: Outcome(404, "not_found_error"),
    InvalidConfigError: Outcome(400, _INVALID, "invalid_runtime_config"),
    InvalidSourceError: Outcome(400, _INVALID),
    InvalidTrafficError: Outcome(400, _INVALID),
    ConflictError: Outcome(409, _INVALID),
    DependencyUnavailable: DEPENDENCY_DOWN,
    IntegrityError: Outcome(500, "server_error"),
    RegistryError: Outcome(500, "server_error"),
}

UNKNOWN = Outcome(500, "server_error")


def status_of(e: BaseException) -> Outcome:
    """The status, error type and code the hub answers (and counts) for `e`. An error caused
    by the database or MLflow not answering (SQLAlchemy's, MLflow's or a registry error raised
    from one) is a 503: the request was fine, retrying once the dependency is back works."""
    if not isinstance(e, HubError | ClientGone) and dependency_down(e) is not None:
        return DEPENDENCY_DOWN
    for cls in type(e).__mro__:
        entry = _TABLE.get(cls)
        if entry is not None:
            return entry if isinstance(entry, Outcome) else entry(e)
    return UNKNOWN


def mapped_classes() -> tuple[type[BaseException], ...]:
    """The exception classes the table names (each gets an error handler)."""
    return tuple(_TABLE)
