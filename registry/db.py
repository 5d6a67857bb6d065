"""Database engine, sessions and schema migrations for the hub's own tables.

SQLite is the embedded default; PostgreSQL works by URL (`postgresql+psycopg://...`). The
hub's Alembic history lives in `migrations/` and records its revision in its own version
table, so it can share a database with MLflow, which keeps `alembic_version` for itself.

Several processes may migrate one PostgreSQL database at once (replicas starting together,
a migration Job beside them): `upgrade` and `downgrade` hold a PostgreSQL advisory lock, so
one migrates and the others wait, then find the schema at its head. SQLite serialises
writers itself.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

VERSION_TABLE = "hub_alembic_version"

# Keys of the PostgreSQL advisory locks the hub takes (one 64-bit key space per database,
# shared with every other client of it: these spell "hub:migr" and "hub:regi" in ASCII).
MIGRATION_LOCK = 0x6875623A6D696772
REGISTRATION_LOCK = 0x6875623A72656769

log = logging.getLogger(__name__)


def sqlite_path(url: str) -> Path | None:
    """The file behind a sqlite URL, None for other databases or in-memory SQLite."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database:
        return None
    if parsed.database == ":memory:":
        return None
    return Path(parsed.database)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=10000")
    cursor.close()


class Database:
    """One engine and session factory per database URL; sessions commit or roll back whole.

    With `timeout` (seconds), a PostgreSQL connection attempt, a wait for a pooled
    connection and each statement are bounded by it, so a database that stopped answering
    fails a call with SQLAlchemy's OperationalError instead of holding its thread
    (advisory-lock waits are exempt: see `advisory_lock`)."""

    def __init__(self, url: str, *, timeout: float | None = None) -> None:
        self.url = url
        path = sqlite_path(url)
        kwargs: dict[str, Any] = {"pool_pre_ping": True}
        backend = make_url(url).get_backend_name()
        if backend == "sqlite":
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        elif backend == "postgresql" and timeout is not None:
            kwargs["pool_timeout"] = timeout
            kwargs["connect_args"] = {
                "connect_timeout": max(1, math.ceil(timeout)),
                "options": f"-c statement_timeout={round(timeout * 1000)}",
            }
        self.engine: Engine = create_engine(url, **kwargs)
        if self.is_sqlite:
            event.listen(self.engine, "connect", _sqlite_pragmas)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def is_sqlite(self) -> bool:
        return self.engine.dialect.name == "sqlite"

    @contextmanager
    def session(self) -> Iterator[Session]:
        with self._sessions() as session, session.begin():
            yield session

    def exclusive(self, key: int, what: str) -> AbstractContextManager[None]:
        """One process at a time across every client of a PostgreSQL database (an advisory
        lock, see `advisory_lock`); within one process only on SQLite."""
        return advisory_lock(self.engine, key, what)

    def ping(self) -> None:
        """Raise if the database does not answer or the schema is not migrated."""
        if not inspect(self.engine).has_table(VERSION_TABLE):
            raise RuntimeError("database schema is not migrated; run `hub db upgrade`")

    def dispose(self) -> None:
        self.engine.dispose()


@contextmanager
def advisory_lock(engine: Engine, key: int, what: str) -> Iterator[None]:
    """Hold PostgreSQL's session-level advisory lock `key` for the block (no-op on other
    databases). The lock lives on a connection of its own, so the block may use any other
    connection; it is released at the end, or by the server when this process dies."""
    if engine.dialect.name != "postgresql":
        yield
        return
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        if not conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar():
            log.info("another process is %s; waiting for it to finish", what)
            # Waiting for the lock lasts as long as the holder's work (a registration that
            # uploads models): the statement timeout of Database(timeout=) does not apply.
            conn.execute(text("SET statement_timeout = 0"))
            try:
                conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": key})
            finally:
                conn.execute(text("RESET statement_timeout"))
        try:
            yield
        finally:
            conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})


@contextmanager
def migration_lock(url: str) -> Iterator[None]:
    """Serialise schema migrations of one database across processes."""
    engine = create_engine(url, poolclass=NullPool)
    try:
        with advisory_lock(engine, MIGRATION_LOCK, "migrating the hub's tables"):
            yield
    finally:
        engine.dispose()


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    import migrations

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["configure_logger"] = False
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the hub's tables to `revision` (default: the newest). Safe to run from several
    processes at once on PostgreSQL: the others wait for the first, then have nothing to do."""
    from alembic import command

    path = sqlite_path(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
    with migration_lock(url):
        command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    from alembic import command

    with migration_lock(url):
        command.downgrade(alembic_config(url), revision)


def current_revision(url: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
            return ctx.get_current_revision()
    finally:
        engine.dispose()
