"""Which revision a store really holds: its Alembic stamp is trusted only as far as its tables bear it out.

Revision ids 0004, 0007 and 0009 each meant more than one change in ShardLab's history (db/migrations/landed.py): a
store stamped "0007" by 8d72316 holds step_time_predicted_s (today's 0008) and not run_uid (today's 0007). Each
revision file names what it adds (`ADDS`: table -> its new columns, () for the table itself). Walking today's chain
from the first revision up to the stamp, the first revision whose additions the store lacks shows where the stamp
stops being true; the store is re-stamped at the revision before it, and the upgrade runs from there, the additive
revisions skipping what the store already has (db/migrations/additive.py). A store whose tables bear out its stamp
(every store this chain wrote) is left as it is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import sqlalchemy as sa
from alembic.script import Script, ScriptDirectory
from sqlalchemy import Connection

log = logging.getLogger("shardlab.store")


class UnknownRevision(LookupError):
    """The store's stamp is no revision of this version's chain (a newer ShardLab wrote it)."""


@dataclass
class Audit:
    stamped: str | None
    """The store's alembic_version (None: an empty store)."""
    held: str | None
    """The newest revision whose additions, and every earlier one's, the store holds (== stamped when it is true)."""
    first_lacking: str | None = None
    """The first revision at or below the stamp whose additions the store lacks."""
    lacking: list[str] = field(default_factory=list)
    """What that revision adds and the store lacks ("table" or "table.column")."""


def chain(script: ScriptDirectory) -> list[Script]:
    """Today's revisions, first to head."""
    return list(reversed(list(script.walk_revisions("base", "heads"))))


def lacking(conn: Connection, adds: dict[str, tuple[str, ...]]) -> list[str]:
    """The tables and columns of `adds` the store does not have."""
    inspector = sa.inspect(conn)
    out: list[str] = []
    for table, columns in adds.items():
        if not inspector.has_table(table):
            out.append(table)
            continue
        have = {c["name"] for c in inspector.get_columns(table)}
        out += [f"{table}.{c}" for c in columns if c not in have]
    return out


def audit(conn: Connection, script: ScriptDirectory, stamped: str | None) -> Audit:
    """How far the store's stamp is true (raises UnknownRevision for a stamp this chain does not have)."""
    if stamped is None:
        return Audit(None, None)
    revisions = chain(script)
    ids = [r.revision for r in revisions]
    if stamped not in ids:
        raise UnknownRevision(stamped)
    for rev in revisions[:ids.index(stamped) + 1]:
        missing = lacking(conn, getattr(rev.module, "ADDS", {}))
        if missing:
            return Audit(stamped, rev.down_revision, rev.revision, missing)
    return Audit(stamped, stamped)


def restamp(conn: Connection, found: Audit, where: str) -> None:
    """Stamp the store at the revision it really holds (in the caller's transaction)."""
    log.warning("store %s: stamped at revision %s but it lacks %s (what revision %s adds): that stamp was written "
                "when %s meant another change (db/migrations/landed.py); upgrading it from %s, keeping what it has",
                where, found.stamped, ", ".join(found.lacking), found.first_lacking, found.stamped,
                found.held or "the start")
    if found.held is None:
        conn.execute(sa.text("DELETE FROM alembic_version"))
    else:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = :v"), {"v": found.held})
