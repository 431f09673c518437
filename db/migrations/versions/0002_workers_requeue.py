"""Worker bookkeeping (workers table) and experiments.requeue_of.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

from db.migrations import additive
from db.models import UTCDateTime

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None
# what this revision adds, table -> its new columns (() = the table itself): db/migrations/audit.py
ADDS = {"experiments": ("requeue_of",), "workers": ()}


def upgrade() -> None:
    additive.add_column("experiments", sa.Column("requeue_of", sa.Integer(), nullable=True))
    additive.create_table(
        "workers",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid_started", sa.Float(), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("experiment_id", sa.Integer(), nullable=True),
        sa.Column("started_at", UTCDateTime(), nullable=False),
        sa.Column("heartbeat_at", UTCDateTime(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("workers")
    with op.batch_alter_table("experiments") as batch:
        batch.drop_column("requeue_of")
