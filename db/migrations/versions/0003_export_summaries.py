"""Export summaries: experiment_summaries (maxima over ranks, error %, versions) and per-rank comm
totals on rank_results, backfilled from the rows already stored.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

from db.migrations import additive

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

CATEGORIES = ("params", "grads", "optimizer", "activations", "other", "peak")
ERROR_CATEGORIES = ("params", "grads", "optimizer", "activations", "peak")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "recv")
COMM_TOTALS = {"comm_bytes": "bytes", "comm_wire_bytes": "wire_bytes", "comm_predicted_bytes": "predicted_bytes",
               "comm_seconds": "seconds"}
RANK_COMM = [*COMM_TOTALS, *[f"comm_{c}_bytes" for c in COLLECTIVES]]
MEM = [f"{kind}_{c}_bytes" for c in CATEGORIES for kind in ("measured", "predicted")]
# what this revision adds, table -> its new columns (() = the table itself): db/migrations/audit.py
ADDS = {"rank_results": tuple(RANK_COMM), "experiment_summaries": ()}


def upgrade() -> None:
    if additive.has_table("experiment_summaries"):
        return  # a store that has it was upgraded and backfilled already
    for name in RANK_COMM:
        additive.add_column("rank_results", sa.Column(name, sa.Float(), nullable=True))
    op.create_table(
        "experiment_summaries",
        sa.Column("experiment_id", sa.Integer(), sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True),
        *[sa.Column(name, sa.BigInteger(), nullable=True) for name in MEM],
        *[sa.Column(f"error_pct_{c}", sa.Float(), nullable=True) for c in ERROR_CATEGORIES],
        *[sa.Column(name, sa.Float(), nullable=True) for name in RANK_COMM],
        sa.Column("torch_version", sa.String(64), nullable=True),
        sa.Column("python_version", sa.String(64), nullable=True),
    )
    _backfill()


def _backfill() -> None:
    """Same numbers db.result_rows computes for new results, in SQL, from the existing rows."""
    match = "c.experiment_id = rank_results.experiment_id AND c.rank = rank_results.rank"
    sets = [f"{name} = (SELECT SUM(c.{col}) FROM comm_records c WHERE {match})" for name, col in COMM_TOTALS.items()]
    sets += [f"comm_{coll}_bytes = (SELECT MAX(c.bytes) FROM comm_records c WHERE {match} AND c.collective = '{coll}')"
             for coll in COLLECTIVES]
    op.execute("UPDATE rank_results SET " + ", ".join(sets))
    cols = [*MEM, *RANK_COMM]
    op.execute(f"INSERT INTO experiment_summaries (experiment_id, {', '.join(cols)}) "
               f"SELECT experiment_id, {', '.join(f'MAX({c})' for c in cols)} FROM rank_results GROUP BY experiment_id")
    op.execute("INSERT INTO experiment_summaries (experiment_id) SELECT id FROM experiments WHERE result_json IS NOT "
               "NULL AND id NOT IN (SELECT experiment_id FROM experiment_summaries)")
    errors = [f"error_pct_{c} = CASE WHEN predicted_{c}_bytes > 0 AND measured_{c}_bytes IS NOT NULL THEN "
              f"(measured_{c}_bytes - predicted_{c}_bytes) * 1.0 / predicted_{c}_bytes * 100.0 END"
              for c in ERROR_CATEGORIES]
    op.execute("UPDATE experiment_summaries SET " + ", ".join(errors))
    if op.get_bind().dialect.name == "sqlite":
        env = "(SELECT e.env_json FROM experiments e WHERE e.id = experiment_summaries.experiment_id)"
        op.execute(f"UPDATE experiment_summaries SET torch_version = json_extract({env}, '$.torch'), "
                   f"python_version = json_extract({env}, '$.python')")
    elif op.get_bind().dialect.name == "postgresql":
        env = "(SELECT e.env_json::json FROM experiments e WHERE e.id = experiment_summaries.experiment_id)"
        op.execute(f"UPDATE experiment_summaries SET torch_version = {env} ->> 'torch', "
                   f"python_version = {env} ->> 'python'")


def downgrade() -> None:
    op.drop_table("experiment_summaries")
    with op.batch_alter_table("rank_results") as batch:
        for name in RANK_COMM:
            batch.drop_column(name)
