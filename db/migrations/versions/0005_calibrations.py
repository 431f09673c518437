"""Calibrations: step-time model parameters fitted to stored runs (additive).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

from db.migrations import additive

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None
# what this revision adds, table -> its new columns (() = the table itself): db/migrations/audit.py
ADDS = {"calibrations": ()}


def upgrade() -> None:
    # a store from branch i13 (01078c6) has it already, made by that branch's "0004" (the same table)
    additive.create_table(
        "calibrations",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("hardware", sa.String(64), nullable=False),
        sa.Column("params_json", sa.Text(), nullable=False),
        sa.Column("fit_run_ids_json", sa.Text(), nullable=False),
        sa.Column("loo_mape", sa.Float(), nullable=True),
        sa.Column("band_low", sa.Float(), nullable=True),
        sa.Column("band_high", sa.Float(), nullable=True),
        sa.Column("ranges_json", sa.Text(), nullable=True),
        sa.Column("notes_json", sa.Text(), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("calibrations")
