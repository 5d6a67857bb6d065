"""rate limits shared by replicas

`hub_rate_limit_spend`: per rate-limited API key, hub process and time slot, the requests
and tokens that process admitted, rewritten by it every sync interval; every replica sums
the others' rows to hold a key's limits across the fleet. Rows are deleted once their slot
is older than the limit's period.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-27 10:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "hub_rate_limit_spend",
        sa.Column("key_name", sa.String(length=200), nullable=False),
        sa.Column("incarnation", sa.String(length=64), nullable=False),
        sa.Column("span", sa.Integer(), nullable=False),
        sa.Column("slot", sa.BigInteger(), nullable=False),
        sa.Column("replica", sa.String(length=200), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint(
            "key_name", "incarnation", "span", "slot", name=op.f("pk_hub_rate_limit_spend")
        ),
    )
    with op.batch_alter_table("hub_rate_limit_spend", schema=None) as batch_op:
        batch_op.create_index(
            batch_op.f("ix_hub_rate_limit_spend_expires_at"), ["expires_at"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("hub_rate_limit_spend", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_hub_rate_limit_spend_expires_at"))
    op.drop_table("hub_rate_limit_spend")
