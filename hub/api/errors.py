"""Every error leaves the hub in OpenAI's shape: {"error": {message, type, param, code}}.

The status, type and code come from `status_of` (hub.outcome), the table the request
metrics read too; this module adds what only the answer carries: the message, the
offending parameter, and headers (`Retry-After` for capacity, the version that answered).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from backends.errors import (
    BackendClosedError,
    BackendError,
    CapacityError,
    InputError,
    LoadError,
    TransientError,
)
from hub.api.serving import VERSION_HEADER
from hub.errors import HubError
from hub.outcome import CLIENT_CLOSED, DEPENDENCY_DOWN, UNKNOWN, mapped_classes, status_of
from registry.errors import InvalidConfigError
from registry.outage import OUTAGE_CLASSES, as_unavailable

# Seconds a client should wait before retrying, by error.
LOAD_RETRY_AFTER = 5
CLOSED_RETRY_AFTER = 1
DEPENDENCY_RETRY_AFTER = 5


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: Any = None


class ErrorResponse(BaseModel):
    """The body of every error answer (OpenAI's shape)."""

    error: ErrorDetail


_MEANING = {
    400: "the request is invalid (the error names the field)",
    401: "missing or wrong API key",
    403: "the key may not do this",
    404: "no such model, version, alias or resource",
    409: "conflicts with the current state",
    413: "the request body is over the hub's limit",
    503: "no capacity now, the model is loading or failed to load, or the registry's "
    "database or MLflow is unreachable (see Retry-After)",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` documenting the error statuses a router's routes answer."""
    return {s: {"model": ErrorResponse, "description": _MEANING[s]} for s in statuses}


def error_body(message: str, error_type: str, param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _validation_message(e: RequestValidationError) -> tuple[str, str | None]:
    problems = []
    first_param = None
    for err in e.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join(loc) or "body"
        first_param = first_param or field
        problems.append(f"{field}: {err.get('msg')}")
    return "; ".join(problems), first_param


def _details(e: Exception) -> tuple[str, str | None, dict[str, str]]:
    """The message, the parameter at fault and the headers of the answer to `e`."""
    headers: dict[str, str] = {}
    if status_of(e) is DEPENDENCY_DOWN:
        headers["Retry-After"] = str(DEPENDENCY_RETRY_AFTER)
        # A library's own error (SQLAlchemy, requests) is reworded: its text names hosts.
        outage = as_unavailable(e, "the registry could not be reached")
        return str(outage or e), None, headers
    if isinstance(e, HubError):
        return e.message, e.param, dict(e.headers)
    if isinstance(e, RequestValidationError):
        message, param = _validation_message(e)
        return message, param, headers
    if isinstance(e, InvalidConfigError):  # a runtime config key, named as the request does
        return str(e), f"config.{e.key}" if e.key else "config", headers
    if isinstance(e, StarletteHTTPException):  # no such route (404), method (405)
        return str(e.detail), None, dict(e.headers or {})
    if isinstance(e, BackendError):
        if e.served_by is not None:
            headers[VERSION_HEADER] = e.served_by
        if isinstance(e, CapacityError | TransientError):
            headers["Retry-After"] = str(max(1, round(e.retry_after)))
        elif isinstance(e, BackendClosedError):
            headers["Retry-After"] = str(CLOSED_RETRY_AFTER)
        elif isinstance(e, LoadError):
            headers["Retry-After"] = str(LOAD_RETRY_AFTER)
            return f"model failed to load: {e}", None, headers
        param = e.param if isinstance(e, InputError) else None
        return str(e), param, headers
    if status_of(e) is UNKNOWN:
        # Not one of ours: its text may say nothing to the caller (the traceback is logged).
        return f"internal error ({type(e).__name__}); the hub's log has the details", None, {}
    return str(e), None, headers


async def error_response(_: Request, e: Exception) -> Response:
    """The answer to `e`: its status from `status_of`, in OpenAI's error shape."""
    outcome = status_of(e)
    if outcome.status == CLIENT_CLOSED:
        # Nobody reads this answer; 499 is for the logs.
        return Response(status_code=CLIENT_CLOSED)
    message, param, headers = _details(e)
    body = error_body(message, outcome.error_type, param, outcome.code)
    return JSONResponse(body, outcome.status, headers=headers or None)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every exception the table maps, and any other one as a 500, in one shape."""
    # The database's and MLflow's own outage errors have handlers of their own: a handler
    # for `Exception` alone answers but re-raises (Starlette's server-error path).
    for cls in (*mapped_classes(), *OUTAGE_CLASSES, Exception):
        if issubclass(cls, Exception):  # CancelledError never reaches a handler
            app.add_exception_handler(cls, error_response)
