"""Several processes migrating one empty PostgreSQL database at once (replicas starting
together, a migration Job beside them): one migrates, the others wait for its advisory lock
and find the schema at its head. Without the lock two concurrent upgrades crashed with
duplicate keys in 5 of 8 trials."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text

from benchmarks.launch.process import REPO
from registry.db import MIGRATION_LOCK, alembic_config, current_revision, upgrade
from registry.schema import Base
from tests.support.postgres import throwaway_postgres

pytestmark = pytest.mark.postgres

HUB_TABLES = set(Base.metadata.tables)
WAITING = text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")


def head() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def hub_tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return HUB_TABLES & set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_waits_for_the_migration_lock() -> None:
    with throwaway_postgres() as urls:
        url = urls["hub"]
        engine = create_engine(url)
        errors: list[BaseException] = []

        def migrate() -> None:
            try:
                upgrade(url)
            except BaseException as e:  # reported by the assertion below
                errors.append(e)

        try:
            with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as holder:
                holder.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK})
                worker = threading.Thread(target=migrate)
                worker.start()
                # The upgrade is queued behind our lock (seen in pg_locks), and has created
                # nothing while it waits.
                deadline = time.monotonic() + 60
                while not holder.execute(WAITING).scalar():
                    assert time.monotonic() < deadline, "the upgrade never asked for the lock"
                    assert worker.is_alive(), f"the upgrade did not wait: {errors}"
                    time.sleep(0.05)
                assert hub_tables(url) == set()
                holder.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK})
            worker.join(120)
            assert not worker.is_alive() and errors == []
            assert current_revision(url) == head()
            assert hub_tables(url) == HUB_TABLES
        finally:
            engine.dispose()


@pytest.mark.slow
def test_concurrent_upgrades_of_an_empty_database_all_succeed() -> None:
    with throwaway_postgres(("a", "b")) as urls:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        for url in urls.values():
            script = f"from registry.db import upgrade; upgrade({url!r})"
            procs = [
                subprocess.Popen(
                    [sys.executable, "-c", script],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for _ in range(3)
            ]
            outputs = [p.communicate(timeout=180)[0] for p in procs]
            assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(outputs)
            assert current_revision(url) == head()
            assert hub_tables(url) == HUB_TABLES
