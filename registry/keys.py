"""API keys: created once (the plain key is shown only then), stored as sha256 hashes."""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from dataclasses import dataclass

from sqlalchemy import select

from registry.db import Database
from registry.errors import ConflictError, NotFoundError
from registry.schema import ApiKey, utcnow

ROLES = ("admin", "user")
KEY_PREFIX = "hub-"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class KeyView:
    name: str
    prefix: str
    role: str
    created_at: dt.datetime
    revoked_at: dt.datetime | None


class ApiKeys:
    def __init__(self, db: Database) -> None:
        self.db = db

    def create(self, name: str, role: str) -> tuple[str, KeyView]:
        """A new key for `role`; returns the plain key (shown once) and its record."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        with self.db.session() as s:
            if s.scalar(select(ApiKey).where(ApiKey.name == name)) is not None:
                raise ConflictError(f"an API key named {name!r} exists already")
            row = ApiKey(name=name, key_hash=hash_key(key), prefix=key[:10], role=role)
            s.add(row)
            s.flush()
            return key, self._view(row)

    def verify(self, key: str) -> tuple[str, str] | None:
        """(name, role) of a valid, unrevoked key, else None."""
        with self.db.session() as s:
            row = s.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key)))
            if row is None or row.revoked_at is not None:
                return None
            return row.name, row.role

    def revoke(self, name: str) -> KeyView:
        with self.db.session() as s:
            row = s.scalar(select(ApiKey).where(ApiKey.name == name))
            if row is None:
                raise NotFoundError(f"no API key named {name!r}")
            row.revoked_at = utcnow()
            return self._view(row)

    def list(self) -> list[KeyView]:
        with self.db.session() as s:
            return [self._view(r) for r in s.scalars(select(ApiKey).order_by(ApiKey.name))]

    @staticmethod
    def _view(row: ApiKey) -> KeyView:
        return KeyView(row.name, row.prefix, row.role, row.created_at, row.revoked_at)
