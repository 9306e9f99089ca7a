"""The ledger: one row per task.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

MONEY = sa.Numeric(20, 12)


def upgrade() -> None:
    op.create_table(
        "ledger",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("request_id", sa.String(64), nullable=False, unique=True),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("api_key_id", sa.String(64)),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("tier", sa.String(32)),
        sa.Column("worker_id", sa.String(128)),
        sa.Column("worker_class", sa.String(32)),
        sa.Column("routing_reason", sa.String(256)),
        sa.Column("cache_result", sa.String(16), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("queue_s", sa.Float(), nullable=False),
        sa.Column("ttft_s", sa.Float(), nullable=False),
        sa.Column("tpot_s", sa.Float(), nullable=False),
        sa.Column("e2e_s", sa.Float(), nullable=False),
        sa.Column("gpu_seconds", sa.Float(), nullable=False),
        sa.Column("list_cost_usd", MONEY, nullable=False),
        sa.Column("measured_cost_usd", MONEY, nullable=False),
        sa.Column("sla_class", sa.String(32), nullable=False),
        sa.Column("sla_met", sa.Boolean(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("enqueued_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_ledger_tenant_finished", "ledger", ["tenant", "finished_at"])
    op.create_index("ix_ledger_model_finished", "ledger", ["model", "finished_at"])
    op.create_index("ix_ledger_finished", "ledger", ["finished_at"])


def downgrade() -> None:
    op.drop_table("ledger")
