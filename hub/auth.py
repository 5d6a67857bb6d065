"""Bearer-key authentication: admin paths need an admin key, inference paths a user (or
admin) key, when `auth.enabled`. `check` answers the `Caller`: the key's name, role and
policy (hub.api.keys_access enforces its models; the scheduler reads its priority, metering
its name).

Verified keys are cached to keep SQL off the hot path. Every change to a key increments a
counter in SQL (registry.keys); `watch` reads it every `GENERATION_INTERVAL` seconds and
drops the cache when it moved, so a revoked or narrowed key stops working on every replica
within about a second. With SQL unreachable the cache serves as before (entries live
`CACHE_SECONDS`) and the outage is logged once.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from backends.workers import WorkerPool
from hub.errors import Forbidden, Unauthorized
from hub.settings import AuthSettings
from registry.keys import ApiKeys, KeyPolicy, hash_key

log = logging.getLogger(__name__)
T = TypeVar("T")

CACHE_SECONDS = 30.0
# How often each replica reads the key generation, and how long one read may take.
GENERATION_INTERVAL = 0.5
GENERATION_TIMEOUT = 2.0
# OpenAI's code for a missing or wrong key; SDKs and gateways branch on it.
INVALID_API_KEY = "invalid_api_key"


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the key's `name` ("anonymous" with auth off), its `role` and its
    `policy` (models, limits, priority, expiry). With auth off every caller is an admin
    with no restriction."""

    name: str
    role: str
    policy: KeyPolicy = field(repr=False)

    @classmethod
    def of(cls, policy: KeyPolicy) -> Caller:
        return cls(policy.name, policy.role, policy)


ANONYMOUS = Caller.of(KeyPolicy("anonymous", "admin"))
BOOTSTRAP = Caller.of(KeyPolicy("bootstrap-admin", "admin"))


class Authenticator:
    def __init__(self, settings: AuthSettings, keys: ApiKeys) -> None:
        self.settings = settings
        self.keys = keys
        # sha256 of a key -> (its caller, None when invalid; monotonic time verified).
        self._cache: dict[str, tuple[Caller | None, float]] = {}
        # Moves each time the cache is dropped: a verification that started before a drop
        # is not cached after it (it may have read the key before the change).
        self._epoch = 0
        self._generation: int | None = None
        self._sql_down = False
        self._reading: asyncio.Future[int] | None = None
        # Keys that miss the cache are checked in SQL on threads of their own
        # (backends/workers.py): a flood of unknown keys waits behind itself only.
        self._threads = WorkerPool("auth", 2)
        # The generation read has its own thread: a hung database never holds up checks.
        self._watch_thread = WorkerPool("auth-generation", 1)

    async def check(self, authorization: str | None, api_key: str | None, *, admin: bool) -> Caller:
        """The caller once allowed: 401 without a valid key, 403 for a user key on an admin
        path; `ANONYMOUS` with auth off."""
        if not self.settings.enabled:
            return ANONYMOUS
        key = _key(authorization, api_key)
        if not key:
            raise Unauthorized(
                "an API key is required: send `Authorization: Bearer <key>`",
                code=INVALID_API_KEY,
                headers={"WWW-Authenticate": "Bearer"},
            )
        caller = await self._caller(key)
        if caller is None:
            raise Unauthorized(
                "invalid, expired or revoked API key",
                code=INVALID_API_KEY,
                headers={"WWW-Authenticate": "Bearer"},
            )
        if admin and caller.role != "admin":
            raise Forbidden("this path needs an admin key")
        return caller

    def cached(self, authorization: str | None, api_key: str | None) -> Caller | None:
        """The caller of an inference request with these headers, decided without I/O:
        `ANONYMOUS` with auth off, else the bootstrap admin or a key verified within
        CACHE_SECONDS. None also when the key is merely unknown here (the HTTP edge then
        lets the request go the whole way, where `check` decides)."""
        if not self.settings.enabled:
            return ANONYMOUS
        key = _key(authorization, api_key)
        if not key:
            return None
        if self._is_bootstrap(key):
            return BOOTSTRAP
        cached = self._cache.get(hash_key(key))
        if cached is None or time.monotonic() - cached[1] >= CACHE_SECONDS:
            return None
        caller = cached[0]
        return caller if caller is not None and not caller.policy.expired() else None

    def known_user(self, authorization: str | None, api_key: str | None) -> bool:
        """Whether `cached` knows this caller (a valid key, without I/O)."""
        return self.cached(authorization, api_key) is not None

    async def watch(self) -> None:
        """Drop the cache whenever the key generation in SQL moves; runs until cancelled."""
        while True:
            await self.poll_generation()
            await asyncio.sleep(GENERATION_INTERVAL)

    async def poll_generation(self) -> None:
        """Read the key generation once (within GENERATION_TIMEOUT) and drop the cache if it
        moved since the last read. A failed read keeps the cache and is logged once."""
        # A read that outlived its timeout is awaited again, never doubled up behind.
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._watch_thread.run(self.keys.generation))
        try:
            async with asyncio.timeout(GENERATION_TIMEOUT):  # never wait_for: see calls.py
                generation = await asyncio.shield(self._reading)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not self._sql_down:
                self._sql_down = True
                log.warning("cannot read the API key generation (%s: %s); serving keys verified "
                            "within %gs from the cache until it answers, so a revocation may "
                            "take that long", type(e).__name__, e, CACHE_SECONDS)  # fmt: skip
            return
        if self._sql_down:
            self._sql_down = False
            log.info("the API key generation answers again; revocations apply within a second")
        # The first read drops too: keys verified before it may predate a change.
        if generation != self._generation:
            self.drop_cache()
        self._generation = generation

    async def run_sql(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on the threads that verify keys: the admin key routes' few
        calls wait behind key checks, never behind the registry's or a model's work."""
        return await self._threads.run(fn, *args, **kwargs)

    def drop_cache(self) -> None:
        """Forget every verified key: the next request of each is checked in SQL."""
        self._cache.clear()
        self._epoch += 1

    def close(self) -> None:
        self._threads.close()
        self._watch_thread.close()

    async def _caller(self, key: str) -> Caller | None:
        if self._is_bootstrap(key):
            return BOOTSTRAP
        digest = hash_key(key)
        cached = self._cache.get(digest)
        now = time.monotonic()
        if cached is not None and now - cached[1] < CACHE_SECONDS:
            caller = cached[0]
            return caller if caller is not None and not caller.policy.expired() else None
        epoch = self._epoch
        policy = await self._threads.run(self.keys.verify, key)
        caller = Caller.of(policy) if policy is not None else None
        if epoch == self._epoch:
            self._cache[digest] = (caller, now)
        return caller

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
