"""Errors the hub turns into HTTP answers.

Each carries the status, an OpenAI-style error type and a message the caller can act on:
4xx for the caller's mistakes, 503 with `Retry-After` when capacity is short.
"""

from __future__ import annotations


class HubError(Exception):
    status_code = 500
    error_type = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


class BadRequest(HubError):
    status_code = 400
    error_type = "invalid_request_error"


class Unauthorized(HubError):
    status_code = 401
    error_type = "authentication_error"


class Forbidden(HubError):
    status_code = 403
    error_type = "permission_error"


class NotFound(HubError):
    status_code = 404
    error_type = "not_found_error"


class Conflict(HubError):
    status_code = 409
    error_type = "conflict_error"


class Unavailable(HubError):
    """Capacity or a model's state stops the request now; retrying later may work."""

    status_code = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, retry_after: float = 2.0, code: str | None = None) -> None:
        super().__init__(
            message, code=code, headers={"Retry-After": str(max(1, round(retry_after)))}
        )
        self.retry_after = retry_after
