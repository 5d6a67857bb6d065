"""traffic statistics shared by replicas, and leases

`hub_traffic_stats`: per hub process, model version and traffic-policy revision, cumulative
request counts and a latency histogram, flushed every few seconds; readouts and canaries add
up every process's rows. `hub_leases`: one canary analyst at a time.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25 10:05:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "hub_traffic_stats",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("version_label", sa.String(length=200), nullable=False),
        sa.Column("policy_revision", sa.Integer(), nullable=False),
        sa.Column("replica", sa.String(length=200), nullable=False),
        sa.Column("incarnation", sa.String(length=64), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("routed", sa.BigInteger(), nullable=False),
        sa.Column("errors", sa.BigInteger(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("busy_s", sa.Float(), nullable=False),
        sa.Column("latency", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["hub_models.id"],
            name=op.f("fk_hub_traffic_stats_model_id_hub_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hub_traffic_stats")),
        sa.UniqueConstraint(
            "incarnation",
            "model_id",
            "version_label",
            "policy_revision",
            name=op.f("uq_hub_traffic_stats_incarnation_model_id_version_label_policy_revision"),
        ),
    )
    with op.batch_alter_table("hub_traffic_stats", schema=None) as batch_op:
        batch_op.create_index(
            "ix_hub_traffic_stats_model_revision", ["model_id", "policy_revision"], unique=False
        )
        batch_op.create_index(
            batch_op.f("ix_hub_traffic_stats_updated_at"), ["updated_at"], unique=False
        )
    op.create_table(
        "hub_leases",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("holder", sa.String(length=200), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_hub_leases")),
    )


def downgrade() -> None:
    op.drop_table("hub_leases")
    with op.batch_alter_table("hub_traffic_stats", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_hub_traffic_stats_updated_at"))
        batch_op.drop_index("ix_hub_traffic_stats_model_revision")
    op.drop_table("hub_traffic_stats")
