"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-21 04:59:45.557144
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "hub_api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hub_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_hub_api_keys_key_hash")),
        sa.UniqueConstraint("name", name=op.f("uq_hub_api_keys_name")),
    )
    op.create_table(
        "hub_models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hub_models")),
        sa.UniqueConstraint("name", name=op.f("uq_hub_models_name")),
    )
    op.create_table(
        "hub_alias_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("alias", sa.String(length=64), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("version", sa.Integer(), nullable=True),
        sa.Column("from_version", sa.Integer(), nullable=True),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("validation", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["hub_models.id"],
            name=op.f("fk_hub_alias_events_model_id_hub_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hub_alias_events")),
    )
    with op.batch_alter_table("hub_alias_events", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_hub_alias_events_created_at"), ["created_at"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_hub_alias_events_model_id"), ["model_id"], unique=False
        )

    op.create_table(
        "hub_model_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("source_uri", sa.Text(), nullable=False),
        sa.Column("mlflow_model_uri", sa.Text(), nullable=False),
        sa.Column("mlflow_version", sa.String(length=32), nullable=False),
        sa.Column("artifact_uri", sa.Text(), nullable=False),
        sa.Column("manifest", sa.JSON(), nullable=False),
        sa.Column("total_bytes", sa.BigInteger(), nullable=False),
        sa.Column("dtype", sa.String(length=16), nullable=False),
        sa.Column("runtime_config", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("validation", sa.JSON(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["hub_models.id"],
            name=op.f("fk_hub_model_versions_model_id_hub_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hub_model_versions")),
        sa.UniqueConstraint(
            "model_id", "version", name=op.f("uq_hub_model_versions_model_id_version")
        ),
    )
    op.create_table(
        "hub_traffic_splits",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["hub_models.id"],
            name=op.f("fk_hub_traffic_splits_model_id_hub_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hub_traffic_splits")),
        sa.UniqueConstraint(
            "model_id", "version", name=op.f("uq_hub_traffic_splits_model_id_version")
        ),
    )


def downgrade() -> None:
    op.drop_table("hub_traffic_splits")
    op.drop_table("hub_model_versions")
    with op.batch_alter_table("hub_alias_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_hub_alias_events_model_id"))
        batch_op.drop_index(batch_op.f("ix_hub_alias_events_created_at"))

    op.drop_table("hub_alias_events")
    op.drop_table("hub_models")
    op.drop_table("hub_api_keys")
