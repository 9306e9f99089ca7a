"""Rollups count the rejected tasks (refused for the client's own fault) apart from those the SLA counts.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ledger_rollups") as batch:  # SQLite alters a table by copying it
        batch.add_column(sa.Column("rejected", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("ledger_rollups") as batch:
        batch.drop_column("rejected")
