"""Issue 26: experiments.cp, cp_rotate, cp_load_balance (context parallelism), filter and CSV columns copied from the
spec; every run stored before this revision ran without it (cp 1, allgather, balanced: the spec's defaults).

Revision ID: 0010
Revises: 0009 (0009_imported_runs)
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

from db.migrations import additive

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None
# what this revision adds, table -> its new columns (() = the table itself): db/migrations/audit.py
ADDS = {"experiments": ("cp", "cp_rotate", "cp_load_balance")}


def upgrade() -> None:
    # Plain ADD COLUMNs. Stores from the cp branch (bba3d1e..fdd846f) have them already, stamped "0009": that
    # revision was renumbered to 0010 when 0009_imported_runs landed first.
    additive.add_column("experiments", sa.Column("cp", sa.Integer(), nullable=False, server_default="1"))
    additive.add_column("experiments", sa.Column("cp_rotate", sa.String(16), nullable=False,
                                                 server_default="allgather"))
    additive.add_column("experiments", sa.Column("cp_load_balance", sa.Boolean(), nullable=False,
                                                 server_default=sa.true()))


def downgrade() -> None:
    for column in ("cp_load_balance", "cp_rotate", "cp"):
        op.drop_column("experiments", column)  # SQLite >= 3.35 drops a column in place
