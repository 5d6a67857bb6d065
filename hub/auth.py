"""Bearer-key authentication: admin paths need an admin key, inference paths a user (or
admin) key, when `auth.enabled`. Verified keys are cached briefly to keep SQL off the hot
path; a revoked key stops working within that time."""

from __future__ import annotations

import hmac
import time

from backends.workers import WorkerPool
from hub.errors import Forbidden, Unauthorized
from hub.settings import AuthSettings
from registry.keys import ApiKeys, hash_key

CACHE_SECONDS = 30.0
# OpenAI's code for a missing or wrong key; SDKs and gateways branch on it.
INVALID_API_KEY = "invalid_api_key"


class Authenticator:
    def __init__(self, settings: AuthSettings, keys: ApiKeys) -> None:
        self.settings = settings
        self.keys = keys
        self._cache: dict[str, tuple[tuple[str, str] | None, float]] = {}
        # Keys that miss the cache are checked in SQL on threads of their own
        # (backends/workers.py): a flood of unknown keys waits behind itself only.
        self._threads = WorkerPool("auth", 2)

    async def check(self, authorization: str | None, api_key: str | None, *, admin: bool) -> str:
        """The caller's name (the key's name; "anonymous" with auth off) once allowed."""
        if not self.settings.enabled:
            return "anonymous"
        key = _key(authorization, api_key)
        if not key:
            raise Unauthorized(
                "an API key is required: send `Authorization: Bearer <key>`",
                code=INVALID_API_KEY,
                headers={"WWW-Authenticate": "Bearer"},
            )
        identity = await self._identity(key)
        if identity is None:
            raise Unauthorized(
                "invalid or revoked API key",
                code=INVALID_API_KEY,
                headers={"WWW-Authenticate": "Bearer"},
            )
        name, role = identity
        if admin and role != "admin":
            raise Forbidden("this path needs an admin key")
        return name

    def known_user(self, authorization: str | None, api_key: str | None) -> bool:
        """Whether an inference request with these headers is allowed, decided without I/O:
        auth is off, or its key is the bootstrap key or one verified within CACHE_SECONDS.
        False also when the key is merely unknown here (the HTTP edge then lets the request
        go the whole way, where `check` decides)."""
        if not self.settings.enabled:
            return True
        key = _key(authorization, api_key)
        if not key:
            return False
        if self._is_bootstrap(key):
            return True
        cached = self._cache.get(hash_key(key))
        return (
            cached is not None
            and cached[0] is not None
            and (time.monotonic() - cached[1] < CACHE_SECONDS)
        )

    async def _identity(self, key: str) -> tuple[str, str] | None:
        if self._is_bootstrap(key):
            return "bootstrap-admin", "admin"
        digest = hash_key(key)
        cached = self._cache.get(digest)
        now = time.monotonic()
        if cached is not None and now - cached[1] < CACHE_SECONDS:
            return cached[0]
        identity = await self._threads.run(self.keys.verify, key)
        self._cache[digest] = (identity, now)
        return identity

    def close(self) -> None:
        self._threads.close()

    def _is_bootstrap(self, key: str) -> bool:
        bootstrap = self.settings.bootstrap_admin_key
        return bootstrap is not None and hmac.compare_digest(key, bootstrap.get_secret_value())


def _key(authorization: str | None, api_key: str | None) -> str | None:
    """The key a request sends: a bearer token, else the X-API-Key header."""
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token:
            return token.strip()
    return api_key
