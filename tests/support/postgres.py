"""A throwaway PostgreSQL for tests (benchmarks/launch/postgres.py), skipped with the reason
where none can run here."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from benchmarks.launch import postgres
from benchmarks.launch.postgres import PostgresServer, PostgresUnavailable


@contextlib.contextmanager
def postgres_server(dbnames: tuple[str, ...] = ("hub",)) -> Iterator[PostgresServer]:
    """`benchmarks.launch.postgres.postgres_server`, or a skip naming why it cannot run."""
    try:
        with postgres.postgres_server(dbnames) as server:
            yield server
    except PostgresUnavailable as e:
        pytest.skip(str(e))


@contextlib.contextmanager
def throwaway_postgres(dbnames: tuple[str, ...] = ("hub",)) -> Iterator[dict[str, str]]:
    """Yield {dbname: SQLAlchemy URL} for a fresh cluster, or skip naming why none can run."""
    with postgres_server(dbnames) as server:
        yield server.urls
