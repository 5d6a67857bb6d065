"""usage metering

`hub_usage`: per API key name, model, version and UTC hour, the requests, errors, prompt and
completion tokens, embedded inputs and tokens and rerank documents every replica answered,
added by increments (an upsert per row and batch).

Revision ID: 0008
Revises: 0006
Create Date: 2026-11-27 03:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COUNTERS = (
    "requests",
    "errors",
    "prompt_tokens",
    "completion_tokens",
    "embedded_inputs",
    "embedded_tokens",
    "rerank_documents",
)


def upgrade() -> None:
    op.create_table(
        "hub_usage",
        sa.Column("key_name", sa.String(length=200), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        *(sa.Column(name, sa.BigInteger(), nullable=False) for name in COUNTERS),
        sa.PrimaryKeyConstraint("key_name", "model", "version", "hour", name=op.f("pk_hub_usage")),
    )
    with op.batch_alter_table("hub_usage", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_hub_usage_hour"), ["hour"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("hub_usage", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_hub_usage_hour"))
    op.drop_table("hub_usage")
