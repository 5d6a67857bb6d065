"""Every error leaves the hub in OpenAI's shape: {"error": {message, type, param, code}}."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from backends.errors import (
    BackendClosedError,
    BackendError,
    CapacityError,
    InputError,
    LoadError,
)
from hub.api.bodies import ClientGone
from hub.api.serving import VERSION_HEADER
from hub.errors import HubError
from registry.errors import (
    ConflictError,
    IntegrityError,
    InvalidSourceError,
    InvalidTrafficError,
    NotFoundError,
    RegistryError,
)

log = logging.getLogger(__name__)


def error_body(message: str, error_type: str, param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _json(status: int, message: str, error_type: str, param: str | None = None,
          code: Any = None, headers: dict[str, str] | None = None) -> JSONResponse:  # fmt: skip
    return JSONResponse(error_body(message, error_type, param, code), status, headers=headers)


def _served_by(e: BackendError, headers: dict[str, str] | None = None) -> dict[str, str]:
    """`headers` plus the version that answered, when the error came from one."""
    headers = dict(headers or {})
    if e.served_by is not None:
        headers[VERSION_HEADER] = e.served_by
    return headers


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HubError)
    async def _hub(_: Request, e: HubError) -> JSONResponse:
        return _json(e.status_code, e.message, e.error_type, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        problems = []
        first_param = None
        for err in e.errors():
            loc = [str(p) for p in err.get("loc", ()) if p != "body"]
            field = ".".join(loc) or "body"
            first_param = first_param or field
            problems.append(f"{field}: {err.get('msg')}")
        # 400 as OpenAI and vLLM answer it, so SDKs raise their BadRequestError.
        return _json(400, "; ".join(problems), "invalid_request_error", first_param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        headers = dict(e.headers) if e.headers else None
        return _json(e.status_code, str(e.detail), "invalid_request_error", headers=headers)

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, e: ClientGone) -> Response:
        # Nobody reads this answer; 499 is nginx's "client closed request", for the logs.
        return Response(status_code=499)

    @app.exception_handler(InputError)
    async def _input(_: Request, e: InputError) -> JSONResponse:
        return _json(400, str(e), "invalid_request_error", e.param, headers=_served_by(e))

    @app.exception_handler(CapacityError)
    async def _capacity(_: Request, e: CapacityError) -> JSONResponse:
        headers = _served_by(e, {"Retry-After": str(max(1, round(e.retry_after)))})
        return _json(503, str(e), "service_unavailable", headers=headers)

    @app.exception_handler(BackendClosedError)
    async def _closed(_: Request, e: BackendClosedError) -> JSONResponse:
        headers = _served_by(e, {"Retry-After": "1"})
        return _json(503, str(e), "service_unavailable", headers=headers)

    @app.exception_handler(LoadError)
    async def _load(_: Request, e: LoadError) -> JSONResponse:
        return _json(503, f"model failed to load: {e}", "service_unavailable",
                     headers={"Retry-After": "5"})  # fmt: skip

    @app.exception_handler(RegistryError)
    async def _registry(_: Request, e: RegistryError) -> JSONResponse:
        status = {
            NotFoundError: 404,
            InvalidSourceError: 400,
            InvalidTrafficError: 400,
            ConflictError: 409,
            IntegrityError: 500,
        }.get(type(e), 500)
        return _json(status, str(e), "invalid_request_error" if status < 500 else "server_error")
