"""Speculative decoding per task: guesses scored and kept.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table, counts in (("ledger", sa.Integer), ("ledger_rollups", sa.BigInteger)):
        with op.batch_alter_table(table) as batch:  # SQLite alters a table by copying it
            batch.add_column(sa.Column("draft_tokens", counts(), nullable=False, server_default="0"))
            batch.add_column(sa.Column("accepted_draft_tokens", counts(), nullable=False, server_default="0"))


def downgrade() -> None:
    for table in ("ledger", "ledger_rollups"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("accepted_draft_tokens")
            batch.drop_column("draft_tokens")
