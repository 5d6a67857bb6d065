"""replica membership

`hub_replicas`: one heartbeat row per live hub process sharing the database (address, what
it holds, free memory per device, queue depth), rewritten every few seconds.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 16:08:25.004712
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "hub_replicas",
        sa.Column("id", sa.String(length=200), nullable=False),
        sa.Column("address", sa.Text(), nullable=False),
        sa.Column("hub_version", sa.String(length=32), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("models", sa.JSON(), nullable=False),
        sa.Column("devices", sa.JSON(), nullable=False),
        sa.Column("host_free_bytes", sa.BigInteger(), nullable=False),
        sa.Column("queue_depth", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hub_replicas")),
    )
    with op.batch_alter_table("hub_replicas", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_hub_replicas_last_seen"), ["last_seen"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("hub_replicas", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_hub_replicas_last_seen"))
    op.drop_table("hub_replicas")
