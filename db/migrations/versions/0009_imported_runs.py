"""Issue 25: runs imported from other frameworks' logs, and named calibrated profiles.

experiments.source_framework (torchtitan | megatron | deepspeed for kind "imported"; NULL for ShardLab's own runs),
experiments.peak_allocated_bytes / peak_reserved_bytes (max over the ranks a log reports: what those logs give),
rank_results.cuda_max_reserved_bytes, calibrations.name (a profile name such as "h100-ourcluster") and
calibrations.details_json (fit residuals and leave-one-out rows). Additive: older rows read NULL.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

from db.migrations import additive

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None
# what this revision adds, table -> its new columns (() = the table itself): db/migrations/audit.py
ADDS = {"experiments": ("source_framework", "peak_allocated_bytes", "peak_reserved_bytes"),
        "rank_results": ("cuda_max_reserved_bytes",), "calibrations": ("name", "details_json")}


def upgrade() -> None:
    # Plain ADD COLUMNs (a batch copy of experiments would cascade-delete its child rows on SQLite).
    additive.add_column("experiments", sa.Column("source_framework", sa.String(32), nullable=True))
    additive.add_column("experiments", sa.Column("peak_allocated_bytes", sa.BigInteger(), nullable=True))
    additive.add_column("experiments", sa.Column("peak_reserved_bytes", sa.BigInteger(), nullable=True))
    additive.add_column("rank_results", sa.Column("cuda_max_reserved_bytes", sa.BigInteger(), nullable=True))
    additive.add_column("calibrations", sa.Column("name", sa.String(64), nullable=True))
    additive.add_column("calibrations", sa.Column("details_json", sa.Text(), nullable=True))
    additive.create_index("ix_calibrations_name", "calibrations", ["name"])


def downgrade() -> None:
    op.drop_index("ix_calibrations_name", table_name="calibrations")
    op.drop_column("calibrations", "details_json")
    op.drop_column("calibrations", "name")
    op.drop_column("rank_results", "cuda_max_reserved_bytes")
    op.drop_column("experiments", "peak_reserved_bytes")
    op.drop_column("experiments", "peak_allocated_bytes")
    op.drop_column("experiments", "source_framework")
