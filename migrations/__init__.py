"""Alembic environment and revisions for the hub's own tables (see registry.db.upgrade)."""
