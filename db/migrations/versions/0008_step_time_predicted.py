"""Issue 20 item 13: experiment_summaries.step_time_predicted_s (RunResult.step_time_predicted_s, the step-time
model's prediction at run time), for the CSV export. Results stored before this revision have none (NULL).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

from db.migrations import additive

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None
# what this revision adds, table -> its new columns (() = the table itself): db/migrations/audit.py
ADDS = {"experiment_summaries": ("step_time_predicted_s",)}


def upgrade() -> None:
    # Stores written between 8d72316 and 20519f9 (and on branches cut then) have it already, stamped "0007": that
    # revision was renumbered to 0008 when today's 0007 (run_uid) landed.
    additive.add_column("experiment_summaries", sa.Column("step_time_predicted_s", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("experiment_summaries", "step_time_predicted_s")
