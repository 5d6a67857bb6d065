"""An outage answer names the dependency that failed, correctly, and never a host, port or
driver text: driven with the errors real drivers raise (psycopg refused by a closed port,
SQLite's lock held by another connection), not with mocks."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy import exc as sql_exc

from benchmarks.launch.process import free_port
from hub.api.errors import error_response
from hub.outcome import DEPENDENCY_DOWN, status_of
from hub.sql_worker import failure_reason
from registry.errors import RegistryError
from registry.outage import as_unavailable, describe


@pytest.fixture(scope="module")
def refused() -> tuple[sql_exc.OperationalError, int]:
    """SQLAlchemy's error for a PostgreSQL server that is not there (a closed port)."""
    port = free_port()
    engine = create_engine(
        f"postgresql+psycopg://hub:pw@127.0.0.1:{port}/hub", connect_args={"connect_timeout": 2}
    )
    with pytest.raises(sql_exc.OperationalError) as caught:
        engine.connect()
    engine.dispose()
    assert f"port {port}" in str(caught.value)  # what the driver says, hosts and all
    return caught.value, port


def _no_host(message: str, port: int) -> None:
    for leak in ("127.0.0.1", str(port), "connection to server", "psycopg", "Connection refused"):
        assert leak not in message, message


async def _answer(e: Exception) -> tuple[int, str]:
    response = await error_response(None, e)  # type: ignore[arg-type]
    return response.status_code, json.loads(bytes(response.body))["error"]["message"]


async def test_a_refused_database_connection_answers_503_naming_the_database_only(
    refused: tuple[sql_exc.OperationalError, int],
) -> None:
    e, port = refused
    # As raised, and wrapped by a registry error whose own text quotes the driver's.
    wrapped = RegistryError(f"reading the registry failed: {e}")
    wrapped.__cause__ = e
    for error in (e, wrapped):
        assert status_of(error) is DEPENDENCY_DOWN
        status, message = await _answer(error)
        assert status == 503
        assert "registry database is unreachable" in message
        _no_host(message, port)
    outage = as_unavailable(e, "registering m")
    assert outage is not None and outage.dependency == "database"
    _no_host(str(outage), port)
    # The one-line reasons background work and replica lists give (a 503 of their own).
    _no_host(failure_reason(e, "replica.sql_timeout"), port)
    assert "registry database is unreachable" in describe(e)


async def test_a_lock_wait_is_not_blamed_on_an_unreachable_database(tmp_path: Path) -> None:
    db = tmp_path / "hub.db"
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("CREATE TABLE t (x INTEGER)")
    holder.execute("BEGIN IMMEDIATE")  # another change holds the write lock
    engine = create_engine(f"sqlite:///{db}", connect_args={"timeout": 0.05})
    try:
        with pytest.raises(sql_exc.OperationalError) as caught, engine.begin() as conn:
            conn.execute(text("INSERT INTO t VALUES (1)"))
    finally:
        holder.execute("ROLLBACK")
        holder.close()
        engine.dispose()
    status, message = await _answer(caught.value)
    assert status == 503
    assert "unreachable" not in message
    assert "registry database is up" in message and "lock" in message
