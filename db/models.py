"""SQLAlchemy 2.0 tables of the experiment store.

`experiments` holds one row per submitted spec: the full spec JSON, first-class filter columns copied
from it, queue/progress bookkeeping, summary numbers and the full RunResult JSON. The child tables
(`rank_results`, `comm_records`, `losses`, `timeline_events`) are the same result normalised so that
export and plots can aggregate in SQL. Every schema change needs an Alembic revision in
db/migrations/versions (tests/unit/test_migrations.py checks the models and migrations agree).
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy import JSON, BigInteger, Boolean, DateTime, Float, ForeignKey, Index, Integer, String, Text, true
from sqlalchemy.orm import DeclarativeBase, Mapped, column_property, mapped_column, relationship
from sqlalchemy.types import TypeDecorator


class UTCDateTime(TypeDecorator):
    """Stored as naive UTC (SQLite has no time zones), returned timezone-aware UTC."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(UTC).replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_run_uid() -> str:
    return uuid.uuid4().hex


class Base(DeclarativeBase):
    pass


class Experiment(Base):
    __tablename__ = "experiments"

    # Revision 0007: ids are never reused (SQLite AUTOINCREMENT; PostgreSQL's sequence never goes back).
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    spec_json: Mapped[str] = mapped_column(Text)
    # Filter columns, copied from the validated spec (derived degrees filled in).
    strategy: Mapped[str] = mapped_column(String(16))
    world_size: Mapped[int] = mapped_column(Integer)
    degrees_json: Mapped[dict] = mapped_column(JSON, default=dict, server_default="{}")  # revision 0011
    """Every field of the parallel-dimension table (backend/spec/dims.py) as {spec field: value}: the degrees and
    their options. Rows, sorts and the export read them from here (db/degrees.py), so a new dimension needs no
    column. The per-degree columns below (dp .. cp_load_balance, schedule, virtual_stages, sequence_parallel) are
    kept with every value a store holds and still written, but no longer read."""
    dp: Mapped[int] = mapped_column(Integer)
    tp: Mapped[int] = mapped_column(Integer)
    pp: Mapped[int] = mapped_column(Integer)
    ep: Mapped[int] = mapped_column(Integer)
    cp: Mapped[int] = mapped_column(Integer, default=1, server_default="1")  # revision 0010
    cp_rotate: Mapped[str] = mapped_column(String(16), default="allgather", server_default="allgather")
    cp_load_balance: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    zero_stage: Mapped[int] = mapped_column(Integer)
    schedule: Mapped[str] = mapped_column(String(32))
    microbatches: Mapped[int] = mapped_column(Integer)
    virtual_stages: Mapped[int] = mapped_column(Integer)
    sequence_parallel: Mapped[bool] = mapped_column(Boolean)
    d_model: Mapped[int] = mapped_column(Integer)
    n_layers: Mapped[int] = mapped_column(Integer)
    n_heads: Mapped[int] = mapped_column(Integer)
    n_kv_heads: Mapped[int] = mapped_column(Integer)
    ffn: Mapped[int] = mapped_column(Integer)
    seq_len: Mapped[int] = mapped_column(Integer)
    vocab: Mapped[int] = mapped_column(Integer)
    n_experts: Mapped[int] = mapped_column(Integer)
    top_k: Mapped[int] = mapped_column(Integer)
    global_batch: Mapped[int] = mapped_column(Integer)
    micro_batch: Mapped[int] = mapped_column(Integer)
    steps: Mapped[int] = mapped_column(Integer)
    precision: Mapped[str] = mapped_column(String(16))
    optimizer: Mapped[str] = mapped_column(String(16))
    recompute: Mapped[str] = mapped_column(String(16))
    framework: Mapped[str] = mapped_column(String(16), default="torch", server_default="torch")  # revision 0006
    # Queue and progress.
    status: Mapped[str] = mapped_column(String(16), default="queued")
    sweep_id: Mapped[str | None] = mapped_column(String(64))
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    worker_id: Mapped[str | None] = mapped_column(String(128))
    host: Mapped[str | None] = mapped_column(String(255))
    progress_step: Mapped[int | None] = mapped_column(Integer)
    progress_total: Mapped[int | None] = mapped_column(Integer)
    progress_phase: Mapped[str | None] = mapped_column(String(32))
    # Failure details (kept for failed/timeout/oom runs: they are results too).
    error: Mapped[str | None] = mapped_column(Text)
    failing_rank: Mapped[int | None] = mapped_column(Integer)
    log_tail: Mapped[str | None] = mapped_column(Text)
    traceback: Mapped[str | None] = mapped_column(Text)
    env_json: Mapped[str | None] = mapped_column(Text)
    # Summary of the result.
    step_s_median: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    loss_max_abs_diff: Mapped[float | None] = mapped_column(Float)
    bubble_measured: Mapped[float | None] = mapped_column(Float)
    bubble_predicted: Mapped[float | None] = mapped_column(Float)
    peak_bytes_max: Mapped[int | None] = mapped_column(BigInteger)
    mfu: Mapped[float | None] = mapped_column(Float)
    wall_s: Mapped[float | None] = mapped_column(Float)
    result_json: Mapped[str | None] = mapped_column(Text)
    # Added by revision 0002: the experiment this row was re-queued from.
    requeue_of: Mapped[int | None] = mapped_column(Integer)
    # Added by revision 0004: "measured" (real ranks) or "traced" (full-scale memory on fake tensors, backend/trace).
    kind: Mapped[str] = mapped_column(String(16), default="measured", server_default="measured")
    # Added by revision 0007: binds a run folder to this row (runs/<id>/run.json, slurm.json), so a folder left by
    # another run with the same id (a deleted row, another store sharing the folder) never speaks for this one.
    run_uid: Mapped[str] = mapped_column(String(32), default=new_run_uid)
    # Added by revision 0009 (issue 25): kind "imported" runs measured by another framework, read from its log.
    source_framework: Mapped[str | None] = mapped_column(String(32))
    """torchtitan, megatron or deepspeed for an imported run; NULL for ShardLab's own runs."""
    peak_allocated_bytes: Mapped[int | None] = mapped_column(BigInteger)
    """Max over ranks of the peak allocated bytes the log reports (torch.cuda.max_memory_allocated)."""
    peak_reserved_bytes: Mapped[int | None] = mapped_column(BigInteger)
    """Max over ranks of the peak reserved bytes the log reports (the caching allocator's reservation)."""

    tags: Mapped[list[ExperimentTag]] = relationship(cascade="all, delete-orphan", passive_deletes=True)

    __table_args__ = (
        Index("ix_experiments_status", "status"),
        Index("ix_experiments_strategy", "strategy"),
        Index("ix_experiments_framework", "framework"),
        Index("ix_experiments_created_at", "created_at"),
        Index("ix_experiments_sweep_id", "sweep_id"),
        Index("ix_experiments_run_uid", "run_uid", unique=True),
        {"sqlite_autoincrement": True},
    )


def _parent() -> Mapped[int]:
    return mapped_column(ForeignKey("experiments.id", ondelete="CASCADE"), index=True)


class ExperimentTag(Base):
    __tablename__ = "experiment_tags"

    experiment_id: Mapped[int] = mapped_column(ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True)
    tag: Mapped[str] = mapped_column(String(200), primary_key=True)

    __table_args__ = (Index("ix_experiment_tags_tag", "tag"),)


class RankResultRow(Base):
    __tablename__ = "rank_results"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    experiment_id: Mapped[int] = _parent()
    rank: Mapped[int] = mapped_column(Integer)
    coords_json: Mapped[str | None] = mapped_column(Text)
    measured_params_bytes: Mapped[int | None] = mapped_column(BigInteger)
    measured_grads_bytes: Mapped[int | None] = mapped_column(BigInteger)
    measured_optimizer_bytes: Mapped[int | None] = mapped_column(BigInteger)
    measured_activations_bytes: Mapped[int | None] = mapped_column(BigInteger)
    measured_other_bytes: Mapped[int | None] = mapped_column(BigInteger)
    measured_peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    predicted_params_bytes: Mapped[int | None] = mapped_column(BigInteger)
    predicted_grads_bytes: Mapped[int | None] = mapped_column(BigInteger)
    predicted_optimizer_bytes: Mapped[int | None] = mapped_column(BigInteger)
    predicted_activations_bytes: Mapped[int | None] = mapped_column(BigInteger)
    predicted_other_bytes: Mapped[int | None] = mapped_column(BigInteger)
    predicted_peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    error_pct_params: Mapped[float | None] = mapped_column(Float)
    error_pct_grads: Mapped[float | None] = mapped_column(Float)
    error_pct_optimizer: Mapped[float | None] = mapped_column(Float)
    error_pct_activations: Mapped[float | None] = mapped_column(Float)
    error_pct_peak: Mapped[float | None] = mapped_column(Float)
    steps_timed: Mapped[int] = mapped_column(Integer, default=0)
    step_s_median: Mapped[float | None] = mapped_column(Float)
    step_s_mean: Mapped[float | None] = mapped_column(Float)
    step_s_min: Mapped[float | None] = mapped_column(Float)
    step_s_max: Mapped[float | None] = mapped_column(Float)
    tokens_per_s_share: Mapped[float | None] = mapped_column(Float)
    rss_bytes: Mapped[int | None] = mapped_column(BigInteger)
    cuda_max_allocated_bytes: Mapped[int | None] = mapped_column(BigInteger)
    cuda_max_reserved_bytes: Mapped[int | None] = mapped_column(BigInteger)  # revision 0010
    # Added by revision 0003: this rank's comm per step (sums over its comm_records), for fast export.
    comm_bytes: Mapped[float | None] = mapped_column(Float)
    comm_wire_bytes: Mapped[float | None] = mapped_column(Float)
    comm_predicted_bytes: Mapped[float | None] = mapped_column(Float)
    comm_seconds: Mapped[float | None] = mapped_column(Float)
    comm_all_reduce_bytes: Mapped[float | None] = mapped_column(Float)
    comm_all_gather_bytes: Mapped[float | None] = mapped_column(Float)
    comm_reduce_scatter_bytes: Mapped[float | None] = mapped_column(Float)
    comm_broadcast_bytes: Mapped[float | None] = mapped_column(Float)
    comm_all_to_all_bytes: Mapped[float | None] = mapped_column(Float)
    comm_send_bytes: Mapped[float | None] = mapped_column(Float)
    comm_recv_bytes: Mapped[float | None] = mapped_column(Float)


class ExperimentSummary(Base):
    """Added by revision 0003: per-experiment maxima over ranks, written with the result, so that the
    one-row-per-experiment export is a plain join (10,000 experiments in well under a second)."""

    __tablename__ = "experiment_summaries"

    experiment_id: Mapped[int] = mapped_column(ForeignKey("experiments.id", ondelete="CASCADE"), primary_key=True)
    measured_params_bytes: Mapped[int | None] = mapped_column(BigInteger)
    predicted_params_bytes: Mapped[int | None] = mapped_column(BigInteger)
    measured_grads_bytes: Mapped[int | None] = mapped_column(BigInteger)
    predicted_grads_bytes: Mapped[int | None] = mapped_column(BigInteger)
    measured_optimizer_bytes: Mapped[int | None] = mapped_column(BigInteger)
    predicted_optimizer_bytes: Mapped[int | None] = mapped_column(BigInteger)
    measured_activations_bytes: Mapped[int | None] = mapped_column(BigInteger)
    predicted_activations_bytes: Mapped[int | None] = mapped_column(BigInteger)
    measured_other_bytes: Mapped[int | None] = mapped_column(BigInteger)
    predicted_other_bytes: Mapped[int | None] = mapped_column(BigInteger)
    measured_peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    predicted_peak_bytes: Mapped[int | None] = mapped_column(BigInteger)
    error_pct_params: Mapped[float | None] = mapped_column(Float)
    error_pct_grads: Mapped[float | None] = mapped_column(Float)
    error_pct_optimizer: Mapped[float | None] = mapped_column(Float)
    error_pct_activations: Mapped[float | None] = mapped_column(Float)
    error_pct_peak: Mapped[float | None] = mapped_column(Float)
    comm_bytes: Mapped[float | None] = mapped_column(Float)
    comm_wire_bytes: Mapped[float | None] = mapped_column(Float)
    comm_predicted_bytes: Mapped[float | None] = mapped_column(Float)
    comm_seconds: Mapped[float | None] = mapped_column(Float)
    comm_all_reduce_bytes: Mapped[float | None] = mapped_column(Float)
    comm_all_gather_bytes: Mapped[float | None] = mapped_column(Float)
    comm_reduce_scatter_bytes: Mapped[float | None] = mapped_column(Float)
    comm_broadcast_bytes: Mapped[float | None] = mapped_column(Float)
    comm_all_to_all_bytes: Mapped[float | None] = mapped_column(Float)
    comm_send_bytes: Mapped[float | None] = mapped_column(Float)
    comm_recv_bytes: Mapped[float | None] = mapped_column(Float)
    torch_version: Mapped[str | None] = mapped_column(String(64))
    python_version: Mapped[str | None] = mapped_column(String(64))
    step_time_predicted_s: Mapped[float | None] = mapped_column(Float)
    """Revision 0008: RunResult.step_time_predicted_s, for the export."""


class CommRecord(Base):
    __tablename__ = "comm_records"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    experiment_id: Mapped[int] = _parent()
    rank: Mapped[int] = mapped_column(Integer)
    collective: Mapped[str] = mapped_column(String(32))
    calls: Mapped[float | None] = mapped_column(Float)
    bytes: Mapped[float | None] = mapped_column(Float)
    wire_bytes: Mapped[float | None] = mapped_column(Float)
    seconds: Mapped[float | None] = mapped_column(Float)
    predicted_bytes: Mapped[float | None] = mapped_column(Float)


class LossRecord(Base):
    __tablename__ = "losses"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    experiment_id: Mapped[int] = _parent()
    step: Mapped[int] = mapped_column(Integer)
    loss: Mapped[float | None] = mapped_column(Float)
    loss_reference: Mapped[float | None] = mapped_column(Float)


FLOAT_MAX = 1.7976931348623157e308


def _diverged(experiment_id) -> sa.Exists:
    """Some stored loss is not finite: NULL (SQLite stores NaN as NULL; a loss row exists only for a step that had
    a loss), beyond the largest float (+-inf; PostgreSQL sorts NaN above every number, so NaN too)."""
    loss = LossRecord.loss
    return sa.exists().where(LossRecord.experiment_id == experiment_id,
                             sa.or_(loss.is_(None), loss > FLOAT_MAX, loss < -FLOAT_MAX))


class TimelineRecord(Base):
    __tablename__ = "timeline_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    experiment_id: Mapped[int] = _parent()
    rank: Mapped[int] = mapped_column(Integer)
    stage: Mapped[int] = mapped_column(Integer)
    microbatch: Mapped[int] = mapped_column(Integer)
    pass_: Mapped[str] = mapped_column("pass", String(16))
    start_s: Mapped[float] = mapped_column(Float)
    end_s: Mapped[float] = mapped_column(Float)


class Worker(Base):
    """Added by revision 0002: one row per worker process, for the dashboard and dead-worker recovery."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    pid: Mapped[int] = mapped_column(Integer)
    host: Mapped[str] = mapped_column(String(255))
    pid_started: Mapped[float | None] = mapped_column(Float)
    """Process creation time (epoch s), so a recycled pid is not mistaken for a live worker."""
    state: Mapped[str] = mapped_column(String(16), default="idle")
    experiment_id: Mapped[int | None] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Calibration(Base):
    """Added by revision 0005: step-time model parameters fitted to stored runs (`python -m backend calibrate`)."""

    __tablename__ = "calibrations"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    hardware: Mapped[str] = mapped_column(String(64))
    """Key of the hardware profile the parameters apply to."""
    params_json: Mapped[str] = mapped_column(Text)
    """Fitted steptime Tunables (JSON object)."""
    fit_run_ids_json: Mapped[str] = mapped_column(Text)
    loo_mape: Mapped[float | None] = mapped_column(Float)
    """Leave-one-out mean absolute percentage error of the step time, in percent."""
    band_low: Mapped[float | None] = mapped_column(Float)
    """Relative lower edge of the prediction interval (e.g. -0.12)."""
    band_high: Mapped[float | None] = mapped_column(Float)
    ranges_json: Mapped[str | None] = mapped_column(Text)
    """Measured range the fit covers (world sizes, link tiers, parameter counts): outside it is extrapolation."""
    notes_json: Mapped[str | None] = mapped_column(Text)
    name: Mapped[str | None] = mapped_column(String(64), index=True)
    """Revision 0009: a calibrated profile's name ("h100-ourcluster"), usable as --hardware; NULL for older rows."""
    details_json: Mapped[str | None] = mapped_column(Text)
    """Revision 0009: {"residuals": [...], "loo": [...], "kinds": {...}} of the fit."""


Experiment.diverged = column_property(_diverged(Experiment.id).label("diverged"), deferred=True)
"""Whether the run diverged (a loss NaN or +-inf): computed from its loss rows, in SQL, for lists and the export."""
