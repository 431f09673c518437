"""experiments.kind: "measured" (a run on real ranks) or "traced" (full-scale memory traced on fake
tensors, backend/trace). Existing rows are measured runs.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

from db.migrations import additive

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None
# what this revision adds, table -> its new columns (() = the table itself): db/migrations/audit.py
ADDS = {"experiments": ("kind",)}


def upgrade() -> None:
    additive.add_column("experiments", sa.Column("kind", sa.String(16), nullable=False, server_default="measured"))


def downgrade() -> None:
    # Not batch mode: on SQLite that recreates `experiments`, and dropping the old table would cascade-delete
    # every child row (rank_results, ...). ALTER TABLE DROP COLUMN (SQLite >= 3.35) keeps them.
    op.drop_column("experiments", "kind")
