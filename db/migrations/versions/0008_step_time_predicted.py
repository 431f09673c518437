"""Issue 20 item 13: experiment_summaries.step_time_predicted_s (RunResult.step_time_predicted_s, the step-time
model's prediction at run time), for the CSV export. Results stored before this revision have none (NULL).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("experiment_summaries", sa.Column("step_time_predicted_s", sa.Float(), nullable=True))


def downgrade() -> None:
    op.drop_column("experiment_summaries", "step_time_predicted_s")
