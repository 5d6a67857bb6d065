"""traffic policies and canaries

Splits may name a version of another model of the same kind (`target_model_id`); the rest of
a policy (shadow, faults, revision) lives in `hub_traffic_policies`; automated canaries in
`hub_canaries`, at most one running per model.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 05:42:17.970204
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RUNNING = sa.text("state = 'running'")


def upgrade() -> None:
    op.create_table(
        "hub_canaries",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("canary_version", sa.Integer(), nullable=False),
        sa.Column("baseline_version", sa.Integer(), nullable=False),
        sa.Column("steps", sa.JSON(), nullable=False),
        sa.Column("step_index", sa.Integer(), nullable=False),
        sa.Column("step_started_at", sa.Float(), nullable=False),
        sa.Column("interval_s", sa.Float(), nullable=False),
        sa.Column("max_error_rate", sa.Float(), nullable=False),
        sa.Column("max_latency_ratio", sa.Float(), nullable=False),
        sa.Column("min_requests", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("last_check", sa.JSON(), nullable=True),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["hub_models.id"],
            name=op.f("fk_hub_canaries_model_id_hub_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hub_canaries")),
    )
    with op.batch_alter_table("hub_canaries", schema=None) as batch_op:
        batch_op.create_index(
            "ix_hub_canaries_one_running",
            ["model_id"],
            unique=True,
            sqlite_where=RUNNING,
            postgresql_where=RUNNING,
        )

    op.create_table(
        "hub_traffic_policies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("shadow_model_id", sa.Integer(), nullable=True),
        sa.Column("shadow_version", sa.Integer(), nullable=True),
        sa.Column("shadow_percent", sa.Float(), nullable=False),
        sa.Column("faults", sa.JSON(), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("updated_by", sa.String(length=200), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["model_id"],
            ["hub_models.id"],
            name=op.f("fk_hub_traffic_policies_model_id_hub_models"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["shadow_model_id"],
            ["hub_models.id"],
            name=op.f("fk_hub_traffic_policies_shadow_model_id_hub_models"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hub_traffic_policies")),
        sa.UniqueConstraint("model_id", name=op.f("uq_hub_traffic_policies_model_id")),
    )

    # Existing split rows (if any were written by hand) name versions of their own model, and
    # get a policy row so they stay visible.
    with op.batch_alter_table("hub_traffic_splits", schema=None) as batch_op:
        batch_op.add_column(sa.Column("target_model_id", sa.Integer(), nullable=True))
    op.execute("UPDATE hub_traffic_splits SET target_model_id = model_id")
    splits = sa.table("hub_traffic_splits", sa.column("model_id", sa.Integer()))
    policies = sa.table(
        "hub_traffic_policies",
        *(sa.column(c) for c in ("model_id", "shadow_percent", "faults", "revision")),
        *(sa.column(c) for c in ("updated_by", "updated_at")),
    )
    models = sa.select(splits.c.model_id).distinct().subquery()
    existing = sa.select(
        models.c.model_id,
        sa.literal(0.0, sa.Float()),
        sa.literal([], sa.JSON()),  # bound through the JSON type: '[]' on every dialect
        sa.literal(1, sa.Integer()),
        sa.literal("migration 0003", sa.String()),
        sa.func.current_timestamp(),
    )
    op.execute(policies.insert().from_select(list(policies.c.keys()), existing))
    with op.batch_alter_table("hub_traffic_splits", schema=None) as batch_op:
        batch_op.alter_column("target_model_id", existing_type=sa.Integer(), nullable=False)
        batch_op.drop_constraint(
            batch_op.f("uq_hub_traffic_splits_model_id_version"), type_="unique"
        )
        batch_op.create_unique_constraint(
            batch_op.f("uq_hub_traffic_splits_model_id_target_model_id_version"),
            ["model_id", "target_model_id", "version"],
        )
        batch_op.create_foreign_key(
            batch_op.f("fk_hub_traffic_splits_target_model_id_hub_models"),
            "hub_models",
            ["target_model_id"],
            ["id"],
            ondelete="CASCADE",
        )


def downgrade() -> None:
    # Splits across models cannot be expressed before 0003: they are dropped.
    op.execute("DELETE FROM hub_traffic_splits WHERE target_model_id <> model_id")
    with op.batch_alter_table("hub_traffic_splits", schema=None) as batch_op:
        batch_op.drop_constraint(
            batch_op.f("fk_hub_traffic_splits_target_model_id_hub_models"), type_="foreignkey"
        )
        batch_op.drop_constraint(
            batch_op.f("uq_hub_traffic_splits_model_id_target_model_id_version"), type_="unique"
        )
        batch_op.create_unique_constraint(
            batch_op.f("uq_hub_traffic_splits_model_id_version"), ["model_id", "version"]
        )
        batch_op.drop_column("target_model_id")

    op.drop_table("hub_traffic_policies")
    with op.batch_alter_table("hub_canaries", schema=None) as batch_op:
        batch_op.drop_index(
            "ix_hub_canaries_one_running", sqlite_where=RUNNING, postgresql_where=RUNNING
        )
    op.drop_table("hub_canaries")
