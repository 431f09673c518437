"""Issue 33: experiments.degrees_json, every parallel-dimension field of a run's spec ({field: value}: the degrees and
their options, backend/spec/dims.py), from which the store reads, sorts and exports them. A dimension added later
needs no revision: its field is in the JSON of the runs that have it and reads as its default in the others.

Existing rows get their values from the columns that held them (dp, tp, pp, ep from revision 0001, cp, cp_rotate,
cp_load_balance from 0010, schedule, virtual_stages, sequence_parallel from 0001): what the store showed before, so
nothing read changes. Those columns are kept, with every value they hold, and are still written.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-29
"""

import sqlalchemy as sa
from alembic import op

from db.migrations import additive

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None
# what this revision adds, table -> its new columns (() = the table itself): db/migrations/audit.py
ADDS = {"experiments": ("degrees_json",)}

FIELDS = {"dp": "dp", "tp": "tp", "pp": "pp", "ep": "ep", "cp": "cp", "cp_rotate": "cp_rotate",
          "cp_load_balance": "cp_load_balance", "sequence_parallel": "sequence_parallel", "pp_schedule": "schedule",
          "virtual_stages": "virtual_stages"}
"""spec field -> the experiments column that held it when this revision was written (frozen: never the live table)."""
BOOLEANS = ("cp_load_balance", "sequence_parallel")


def upgrade() -> None:
    additive.add_column("experiments", sa.Column("degrees_json", sa.JSON(), nullable=False, server_default="{}"))
    bind = op.get_bind()
    table = sa.table("experiments", sa.column("id", sa.Integer()), sa.column("degrees_json", sa.Text()),
                     *[sa.column(c) for c in FIELDS.values()])
    rows = bind.execute(sa.select(table.c.id, sa.cast(table.c.degrees_json, sa.Text()),
                                  *[table.c[c] for c in FIELDS.values()])).all()
    filled = []
    for eid, held, *values in rows:
        if held not in (None, "", "{}"):  # written by this revision's code already (a store upgraded before)
            continue
        degrees = dict(zip(FIELDS, values, strict=False))
        degrees.update({k: bool(degrees[k]) for k in BOOLEANS})
        filled.append({"eid": eid, "degrees": degrees})
    if filled:
        target = sa.table("experiments", sa.column("id", sa.Integer()), sa.column("degrees_json", sa.JSON()))
        stmt = (sa.update(target).where(target.c.id == sa.bindparam("eid"))
                .values(degrees_json=sa.bindparam("degrees", type_=sa.JSON())))
        bind.execute(stmt, filled)


def downgrade() -> None:
    op.drop_column("experiments", "degrees_json")  # SQLite >= 3.35 drops a column in place
