"""key policies

`hub_api_keys.models` / `limits` / `priority` / `expires_at`: which models a key may use, its
rate limits, its scheduling class and when it stops working (null models and limits: every
model, no limits, so existing keys keep working as before). `hub_key_generation`: one row
whose counter every key change increments, read by each replica to drop its cache of
verified keys within a second of a revocation.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-27 03:45:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("hub_api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("models", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("limits", sa.JSON(), nullable=True))
        batch_op.add_column(
            sa.Column("priority", sa.String(length=16), nullable=False, server_default="standard")
        )
        batch_op.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    generation = op.create_table(
        "hub_key_generation",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hub_key_generation")),
    )
    op.bulk_insert(generation, [{"id": 1, "generation": 0}])


def downgrade() -> None:
    op.drop_table("hub_key_generation")
    with op.batch_alter_table("hub_api_keys", schema=None) as batch_op:
        batch_op.drop_column("expires_at")
        batch_op.drop_column("priority")
        batch_op.drop_column("limits")
        batch_op.drop_column("models")
