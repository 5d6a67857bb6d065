"""Alembic upgrade -> downgrade -> upgrade on SQLite and PostgreSQL, beside MLflow's tables."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect

from registry.db import VERSION_TABLE, current_revision, downgrade, upgrade
from registry.schema import Base
from tests.support.postgres import throwaway_postgres

HUB_TABLES = set(Base.metadata.tables)


def tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def roundtrip(url: str) -> None:
    upgrade(url)
    assert tables(url) >= HUB_TABLES
    assert current_revision(url) is not None
    downgrade(url, "base")
    assert not HUB_TABLES & tables(url)
    assert current_revision(url) is None
    upgrade(url)
    assert tables(url) >= HUB_TABLES
    assert VERSION_TABLE in tables(url)


def test_sqlite_roundtrip(tmp_path: Path) -> None:
    roundtrip(f"sqlite:///{tmp_path / 'hub.db'}")


def test_shares_a_database_with_mlflow(tmp_path: Path) -> None:
    """MLflow keeps `alembic_version`; ours is separate, so both migrate one database."""
    from registry.mlflow_store import MlflowStore

    url = f"sqlite:///{tmp_path / 'shared.db'}"
    MlflowStore(url).ping()
    roundtrip(url)
    names = tables(url)
    assert "alembic_version" in names and "registered_models" in names
    assert "hub_model_versions" in names and "model_versions" in names


@pytest.mark.postgres
def test_postgres_roundtrip() -> None:
    with throwaway_postgres() as urls:
        roundtrip(urls["hub"])
