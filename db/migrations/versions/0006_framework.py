"""Issue 14: experiments.framework (torch | deepspeed | jax), a filter column copied from the spec; every run
stored before this revision ran on torch.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

from db.migrations import additive

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None
# what this revision adds, table -> its new columns (() = the table itself): db/migrations/audit.py
ADDS = {"experiments": ("framework",)}


def upgrade() -> None:
    # A store from branch i14 (476d74b) has both already, made by that branch's "0004" (the same column and index).
    additive.add_column("experiments", sa.Column("framework", sa.String(16), nullable=False, server_default="torch"))
    additive.create_index("ix_experiments_framework", "experiments", ["framework"])


def downgrade() -> None:
    op.drop_index("ix_experiments_framework", table_name="experiments")
    op.drop_column("experiments", "framework")  # SQLite >= 3.35 drops a column in place
