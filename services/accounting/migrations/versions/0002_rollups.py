"""Ledger rollups: the ledger summed per hour and day, tenant and model.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

MONEY = sa.Numeric(20, 12)


def upgrade() -> None:
    op.create_table(
        "ledger_rollups",
        sa.Column("period", sa.String(8), primary_key=True),
        sa.Column("bucket_start", sa.DateTime(timezone=True), primary_key=True),
        sa.Column("tenant", sa.String(128), primary_key=True),
        sa.Column("model", sa.String(128), primary_key=True),
        sa.Column("tasks", sa.Integer(), nullable=False),
        sa.Column("ok_tasks", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("list_cost_usd", MONEY, nullable=False),
        sa.Column("measured_cost_usd", MONEY, nullable=False),
        sa.Column("sla_met", sa.Integer(), nullable=False),
        sa.Column("attainment", sa.Float(), nullable=False),
        sa.Column("goodput", sa.Float(), nullable=False),
        sa.Column("ttft_p50_s", sa.Float()),
        sa.Column("ttft_p95_s", sa.Float()),
        sa.Column("ttft_p99_s", sa.Float()),
        sa.Column("tpot_p50_s", sa.Float()),
        sa.Column("tpot_p95_s", sa.Float()),
        sa.Column("tpot_p99_s", sa.Float()),
        sa.Column("raw_pruned", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("rolled_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_ledger_rollups_tenant", "ledger_rollups", ["period", "tenant", "bucket_start"])


def downgrade() -> None:
    op.drop_table("ledger_rollups")
