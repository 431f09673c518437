"""Calibrations: step-time model parameters fitted to stored runs (additive).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
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
