"""version eval set

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21 05:14:16.905144
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("hub_model_versions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("eval_set", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("hub_model_versions", schema=None) as batch_op:
        batch_op.drop_column("eval_set")
