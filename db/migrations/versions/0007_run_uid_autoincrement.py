"""Issue 21: experiment ids are never reused, and each run carries a run_uid that binds its run folder to it.

SQLite gave a new row the id of a deleted newest row, whose run folder (and slurm.json) was still on disk, so a
new SLURM run re-attached to the old job and stored its measurements. The table is rebuilt with AUTOINCREMENT
(batch mode; db.migrations.upgrade runs SQLite migrations with foreign keys off, so dropping the old table
cannot cascade into the child rows). PostgreSQL's id sequence never hands out an id twice already.
Existing rows get a random run_uid.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26
"""

import sqlalchemy as sa
from alembic import op

from db.migrations import additive

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None
# what this revision adds, table -> its new columns (() = the table itself): db/migrations/audit.py
ADDS = {"experiments": ("run_uid",)}

RANDOM_UID = {"sqlite": "(lower(hex(randomblob(16))))", "postgresql": "md5(random()::text || clock_timestamp()::text)"}


def upgrade() -> None:
    conn = op.get_bind()
    dialect = conn.dialect.name
    if additive.has_column("experiments", "run_uid"):
        return
    # a volatile default is evaluated once per existing row: every old run gets its own uid
    column = sa.Column("run_uid", sa.String(32), nullable=False, server_default=sa.text(RANDOM_UID.get(dialect, "''")))
    if dialect == "sqlite":
        fk_on = conn.exec_driver_sql("PRAGMA foreign_keys").scalar()
        if fk_on:
            raise RuntimeError("revision 0007 rebuilds `experiments`: run it through db.migrations.upgrade "
                               "(foreign keys off), or the rebuild would cascade-delete every run's results")
        with op.batch_alter_table("experiments", recreate="always",
                                  table_kwargs={"sqlite_autoincrement": True}) as batch:
            batch.add_column(column)
    else:
        op.add_column("experiments", column)
    op.create_index("ix_experiments_run_uid", "experiments", ["run_uid"], unique=True)
    if dialect == "sqlite":
        bad = conn.exec_driver_sql("PRAGMA foreign_key_check").all()
        if bad:
            raise RuntimeError(f"revision 0007 left {len(bad)} dangling foreign keys: {bad[:5]}")


def downgrade() -> None:
    # AUTOINCREMENT stays (harmless, and rebuilding again would risk the child rows); the column goes in place.
    op.drop_index("ix_experiments_run_uid", table_name="experiments")
    op.drop_column("experiments", "run_uid")
