"""Initial schema: experiments, tags, per-rank results, comm records, losses, timeline events.

Revision ID: 0001
Revises:
Create Date: 2026-11-23
"""

import sqlalchemy as sa
from alembic import op

from db.models import UTCDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None
# what this revision adds, table -> its new columns (() = the table itself): db/migrations/audit.py
ADDS = {t: () for t in ("experiments", "experiment_tags", "rank_results", "comm_records", "losses", "timeline_events")}


def _bytes(name: str) -> sa.Column:
    return sa.Column(name, sa.BigInteger(), nullable=True)


def _parent() -> sa.Column:
    return sa.Column("experiment_id", sa.Integer(), sa.ForeignKey("experiments.id", ondelete="CASCADE"), nullable=False)


def upgrade() -> None:
    ints = ["world_size", "dp", "tp", "pp", "ep", "zero_stage"]
    op.create_table(
        "experiments",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("spec_json", sa.Text(), nullable=False),
        sa.Column("strategy", sa.String(16), nullable=False),
        *[sa.Column(c, sa.Integer(), nullable=False) for c in ints],
        sa.Column("schedule", sa.String(32), nullable=False),
        sa.Column("microbatches", sa.Integer(), nullable=False),
        sa.Column("virtual_stages", sa.Integer(), nullable=False),
        sa.Column("sequence_parallel", sa.Boolean(), nullable=False),
        *[sa.Column(c, sa.Integer(), nullable=False) for c in
          ["d_model", "n_layers", "n_heads", "n_kv_heads", "ffn", "seq_len", "vocab", "n_experts", "top_k",
           "global_batch", "micro_batch", "steps"]],
        sa.Column("precision", sa.String(16), nullable=False),
        sa.Column("optimizer", sa.String(16), nullable=False),
        sa.Column("recompute", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("sweep_id", sa.String(64), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("created_at", UTCDateTime(), nullable=False),
        sa.Column("started_at", UTCDateTime(), nullable=True),
        sa.Column("finished_at", UTCDateTime(), nullable=True),
        sa.Column("heartbeat_at", UTCDateTime(), nullable=True),
        sa.Column("worker_id", sa.String(128), nullable=True),
        sa.Column("host", sa.String(255), nullable=True),
        sa.Column("progress_step", sa.Integer(), nullable=True),
        sa.Column("progress_total", sa.Integer(), nullable=True),
        sa.Column("progress_phase", sa.String(32), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("failing_rank", sa.Integer(), nullable=True),
        sa.Column("log_tail", sa.Text(), nullable=True),
        sa.Column("traceback", sa.Text(), nullable=True),
        sa.Column("env_json", sa.Text(), nullable=True),
        *[sa.Column(c, sa.Float(), nullable=True) for c in
          ["step_s_median", "tokens_per_s", "loss_max_abs_diff", "bubble_measured", "bubble_predicted"]],
        _bytes("peak_bytes_max"),
        sa.Column("mfu", sa.Float(), nullable=True),
        sa.Column("wall_s", sa.Float(), nullable=True),
        sa.Column("result_json", sa.Text(), nullable=True),
    )
    for col in ("status", "strategy", "created_at", "sweep_id"):
        op.create_index(f"ix_experiments_{col}", "experiments", [col])

    op.create_table(
        "experiment_tags",
        sa.Column("experiment_id", sa.Integer(), sa.ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("tag", sa.String(200), primary_key=True),
    )
    op.create_index("ix_experiment_tags_tag", "experiment_tags", ["tag"])

    cats = ["params", "grads", "optimizer", "activations", "other", "peak"]
    op.create_table(
        "rank_results",
        sa.Column("id", sa.Integer(), primary_key=True),
        _parent(),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("coords_json", sa.Text(), nullable=True),
        *[_bytes(f"measured_{c}_bytes") for c in cats],
        *[_bytes(f"predicted_{c}_bytes") for c in cats],
        *[sa.Column(f"error_pct_{c}", sa.Float(), nullable=True)
          for c in ["params", "grads", "optimizer", "activations", "peak"]],
        sa.Column("steps_timed", sa.Integer(), nullable=False),
        *[sa.Column(f"step_s_{s}", sa.Float(), nullable=True) for s in ["median", "mean", "min", "max"]],
        sa.Column("tokens_per_s_share", sa.Float(), nullable=True),
        _bytes("rss_bytes"),
        _bytes("cuda_max_allocated_bytes"),
    )
    op.create_table(
        "comm_records",
        sa.Column("id", sa.Integer(), primary_key=True),
        _parent(),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("collective", sa.String(32), nullable=False),
        *[sa.Column(c, sa.Float(), nullable=True) for c in ["calls", "bytes", "wire_bytes", "seconds",
                                                            "predicted_bytes"]],
    )
    op.create_table(
        "losses",
        sa.Column("id", sa.Integer(), primary_key=True),
        _parent(),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("loss", sa.Float(), nullable=True),
        sa.Column("loss_reference", sa.Float(), nullable=True),
    )
    op.create_table(
        "timeline_events",
        sa.Column("id", sa.Integer(), primary_key=True),
        _parent(),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("stage", sa.Integer(), nullable=False),
        sa.Column("microbatch", sa.Integer(), nullable=False),
        sa.Column("pass", sa.String(16), nullable=False),
        sa.Column("start_s", sa.Float(), nullable=False),
        sa.Column("end_s", sa.Float(), nullable=False),
    )
    for table in ("rank_results", "comm_records", "losses", "timeline_events"):
        op.create_index(f"ix_{table}_experiment_id", table, ["experiment_id"])


def downgrade() -> None:
    for table in ("timeline_events", "losses", "comm_records", "rank_results", "experiment_tags", "experiments"):
        op.drop_table(table)
