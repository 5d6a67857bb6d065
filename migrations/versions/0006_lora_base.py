"""lora base

`hub_model_versions.base_model` / `base_version`: the registered LLM version a LoRA adapter
version was trained against (an alias given at registration is resolved to its version then);
both null for a full model.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25 09:45:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("hub_model_versions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("base_model", sa.String(length=200), nullable=True))
        batch_op.add_column(sa.Column("base_version", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("hub_model_versions", schema=None) as batch_op:
        batch_op.drop_column("base_version")
        batch_op.drop_column("base_model")
