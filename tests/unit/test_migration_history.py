"""Issue 31 item 1: a revision id is never reused and a landed revision is never renumbered (db/migrations/landed.py
is the list of every revision ever in main's history, and it only grows), and each revision's ADDS says exactly
what it adds (db/migrations/audit.py trusts a store's stamp only as far as its tables hold those additions)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import text

from db.migrations import alembic_config, upgrade
from db.migrations.audit import chain, lacking
from db.migrations.landed import LANDED
from db.session import get_engine

VERSIONS = Path(__file__).resolve().parents[2] / "db" / "migrations" / "versions"

FROZEN = (  # landed.LANDED as of issue 31: entries may be appended, never changed or removed
    ("0001", "0001_initial.py"), ("0002", "0002_workers_requeue.py"), ("0003", "0003_export_summaries.py"),
    ("0004", "0004_calibrations.py"), ("0004", "0004_experiment_kind.py"), ("0004", "0004_framework.py"),
    ("0005", "0005_calibrations.py"), ("0006", "0006_framework.py"), ("0007", "0007_step_time_predicted.py"),
    ("0007", "0007_run_uid_autoincrement.py"), ("0008", "0008_step_time_predicted.py"),
    ("0009", "0009_context_parallel.py"), ("0009", "0009_imported_runs.py"), ("0010", "0010_context_parallel.py"),
)


def revision_files() -> list[tuple[str, str]]:
    """(revision id, file name) of every file in versions/, read with ast (Alembic would keep one of two alike)."""
    out = []
    for path in sorted(VERSIONS.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["revision"]:
                out.append((ast.literal_eval(node.value), path.name))
    return out


def test_no_revision_id_is_used_twice_in_the_versions_folder():
    ids = Counter(rev for rev, _ in revision_files())
    assert [rev for rev, n in ids.items() if n > 1] == []


def test_the_landed_list_only_grows():
    assert [(e.revision, e.file) for e in LANDED[:len(FROZEN)]] == list(FROZEN)


def test_every_revision_is_landed_under_an_id_never_used_before():
    live = {(e.revision, e.file) for e in LANDED if e.today is None}
    assert set(revision_files()) == live, "add the new revision to db/migrations/landed.py (ids are never reused)"
    seen: set[str] = {rev for rev, _ in FROZEN}
    for entry in LANDED[len(FROZEN):]:
        assert entry.revision not in seen, f"revision id {entry.revision} was used before ({entry.file})"
        seen.add(entry.revision)
    today = {rev for rev, _ in revision_files()}
    assert all(e.today in today for e in LANDED if e.today is not None)


def test_each_revision_file_adds_what_its_adds_says(tmp_path):
    """At revision R's parent the store lacks all of R's ADDS; at R it lacks none."""
    from alembic.script import ScriptDirectory

    engine = get_engine(f"sqlite:///{tmp_path / 'steps.db'}")
    revisions = chain(ScriptDirectory.from_config(alembic_config()))
    assert [r.revision for r in revisions] == sorted(rev for rev, _ in revision_files())
    for rev in revisions:
        adds = rev.module.ADDS
        assert adds, f"{rev.revision} declares no ADDS"
        with engine.connect() as conn:
            before = lacking(conn, adds)
        upgrade(engine, rev.revision)
        with engine.connect() as conn:
            assert lacking(conn, adds) == [], rev.revision
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == rev.revision
        wanted = [t if not cols else f"{t}.{c}" for t, cols in adds.items() for c in (cols or [None])]
        assert sorted(before) == sorted(wanted), f"{rev.revision}: ADDS names something an earlier revision made"


@pytest.mark.parametrize("entry", [e for e in LANDED if e.today is not None], ids=lambda e: e.file)
def test_a_renumbered_revision_names_the_revision_that_makes_its_change_today(entry):
    from alembic.script import ScriptDirectory

    today = ScriptDirectory.from_config(alembic_config()).get_revision(entry.today)
    assert entry.file.split("_", 1)[1] == Path(today.path).name.split("_", 1)[1]
