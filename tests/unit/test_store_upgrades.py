"""Issue 31 item 1: every store any landed commit wrote opens with today's code, with every value it held.

tests/fixtures/stores/*.db were written by the old commits' own CLI (README.md there says which commit and command
built each). Each is copied, opened with today's code (Alembic upgrade, after db/migrations/audit.py has checked
its stamp against its tables), and every row of every table is compared, column by column, with what the old code
wrote. Revision ids were reused (0004, 0007, 0009), so several of these stores carry a stamp that means another
change today. A schema that cannot be upgraded is a SchemaError (exit 2, named revision, no retry), not an outage.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import sqlite3
import time
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from backend.cli import main
from db import queries as q
from db.export import export_csv, export_json
from db.migrations import SchemaError, current_revision, head_revision, upgrade
from db.migrations.landed import LANDED
from db.models import Base
from db.session import forget_engines, get_engine, init_db, open_db

STORES = Path(__file__).resolve().parents[1] / "fixtures" / "stores"
COVERS = {  # fixture -> (its Alembic stamp, the landed revision at its head: what the commit's versions/ held last)
    "s0003_116aa10": ("0003", "0003_export_summaries.py"),
    "s0003_be576cc": ("0003", "0003_export_summaries.py"),
    "s0004_calibrations_01078c6": ("0004", "0004_calibrations.py"),
    "s0004_framework_476d74b": ("0004", "0004_framework.py"),
    "s0004_kind_0fbdda9": ("0004", "0004_experiment_kind.py"),
    "s0006_4c4a8fc": ("0006", "0006_framework.py"),
    "s0007_step_time_8d72316": ("0007", "0007_step_time_predicted.py"),
    "s0007_run_uid_5c8f967": ("0007", "0007_run_uid_autoincrement.py"),
    "s0008_3d50ac9": ("0008", "0008_step_time_predicted.py"),
    "s0009_cp_fdd846f": ("0009", "0009_context_parallel.py"),
    "s0009_imported_038ae18": ("0009", "0009_imported_runs.py"),
    "s0010_f5f41f2": ("0010", "0010_context_parallel.py"),
    "s0010_6711c58": ("0010", "0010_context_parallel.py"),
    "s0011_8f788ce": ("0011", "0011_degrees_json.py"),
}
NEVER_A_HEAD = {"0001_initial.py", "0002_workers_requeue.py", "0005_calibrations.py"}
"""Landed revisions no commit ever had as its newest (the first commit had 0001-0003; 0005 and 0006 came together)."""


def snapshot(path: Path) -> dict[str, dict[tuple, dict]]:
    """Every row of every table (but Alembic's and SQLite's own), by primary key, as SQLite holds it."""
    con = sqlite3.connect(path)
    try:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT IN "
                                            "('alembic_version', 'sqlite_sequence')")]
        out = {}
        for table in tables:
            info = con.execute(f"PRAGMA table_info({table})").fetchall()
            pk = [c[1] for c in sorted(info, key=lambda c: c[5]) if c[5]] or ["rowid"]
            cur = con.execute(f"SELECT {', '.join(pk)}, * FROM {table}")
            names = [d[0] for d in cur.description][len(pk):]
            out[table] = {tuple(r[:len(pk)]): dict(zip(names, r[len(pk):], strict=False)) for r in cur}
        return out
    finally:
        con.close()


def opened(fixture: str, tmp_path: Path) -> tuple[Path, dict]:
    copy = tmp_path / f"{fixture}.db"
    shutil.copyfile(STORES / f"{fixture}.db", copy)
    return copy, snapshot(copy)


def test_the_fixtures_cover_every_revision_that_was_ever_the_newest():
    assert sorted(p.stem for p in STORES.glob("*.db")) == sorted(COVERS)
    assert {head for _, head in COVERS.values()} == {e.file for e in LANDED} - NEVER_A_HEAD
    for fixture, (stamp, _) in COVERS.items():
        con = sqlite3.connect(STORES / f"{fixture}.db")
        assert con.execute("SELECT version_num FROM alembic_version").fetchall() == [(stamp,)], fixture
        con.close()


@pytest.mark.parametrize("fixture", sorted(COVERS))
@pytest.mark.heavy
def test_a_store_an_older_version_wrote_opens_with_every_value(fixture, tmp_path):
    copy, before = opened(fixture, tmp_path)
    assert before["experiments"], "a fixture holds runs"
    engine = open_db(f"sqlite:///{copy}")
    assert current_revision(engine) == head_revision()
    after = snapshot(copy)
    for table, rows in before.items():
        assert set(after[table]) == set(rows), f"{table}: rows lost or added"
        for key, row in rows.items():
            kept = {col: after[table][key][col] for col in row}
            assert kept == row, f"{table} {key}"
    with engine.connect() as c:
        assert compare_metadata(MigrationContext.configure(c, opts={"compare_type": True}), Base.metadata) == []
    uids = [row["run_uid"]
            for row in (q.get_experiment(engine, i) for i in sorted(k[0] for k in before["experiments"]))]
    assert len(set(uids)) == len(uids) and all(uids)  # today's 0007 reached even the stores stamped with the old one
    listed = q.list_experiments(engine)
    assert sorted(r["id"] for r in listed) == sorted(k[0] for k in before["experiments"])
    for r in listed:
        got = q.get_experiment(engine, r["id"])
        assert got["status"] == before["experiments"][(r["id"],)]["status"]
        if got["status"] == "ok":
            assert got["result"] is not None and got["result"].status == "ok"
    assert export_csv(engine).count("\r\n") == len(listed) + 1 and export_json(engine).startswith("[")


DEGREE_COLUMNS = {"dp": "dp", "tp": "tp", "pp": "pp", "ep": "ep", "cp": "cp", "cp_rotate": "cp_rotate",
                  "cp_load_balance": "cp_load_balance", "sequence_parallel": "sequence_parallel",
                  "pp_schedule": "schedule", "virtual_stages": "virtual_stages"}
"""spec field -> the experiments column that held it before revision 0011 (issue 33)."""


@pytest.mark.parametrize("fixture", sorted(COVERS))
@pytest.mark.heavy
def test_the_degrees_read_from_degrees_json_are_the_values_the_columns_held(fixture, tmp_path):
    """Issue 33: since revision 0011 rows, sorts and the export read the parallel dimensions from
    experiments.degrees_json; every value listed and exported is the one the old columns held (the spec's default
    where the store predates the column: cp 1, allgather, balanced), and the one the run's own spec JSON holds."""
    copy, before = opened(fixture, tmp_path)
    engine = open_db(f"sqlite:///{copy}")
    after = snapshot(copy)["experiments"]
    defaults = {"cp": 1, "cp_rotate": "allgather", "cp_load_balance": 1}
    listed = {r["id"]: r for r in q.list_experiments(engine)}
    exported = {int(r["id"]): r for r in csv.DictReader(io.StringIO(export_csv(engine)))}
    for (eid,), old in before["experiments"].items():
        held = {field: old.get(col, defaults.get(col)) for field, col in DEGREE_COLUMNS.items()}
        assert {f: after[(eid,)][c] for f, c in DEGREE_COLUMNS.items()} == held  # the columns themselves are kept
        as_json = json.loads(after[(eid,)]["degrees_json"])
        assert as_json == {f: bool(v) if f in ("cp_load_balance", "sequence_parallel") else v for f, v in held.items()}
        row = listed[eid]
        assert {f: row[c] for f, c in DEGREE_COLUMNS.items()} == as_json, eid
        parallel = q.get_experiment(engine, eid)["spec"].parallel
        assert {f: (str(v) if isinstance(v, str) else v) for f in DEGREE_COLUMNS for v in [getattr(parallel, f)]} \
            == as_json, f"{fixture} #{eid}: the spec JSON and the columns disagree"
        gate = {"cp_rotate": "cp", "cp_load_balance": "cp", "pp_schedule": "pp", "virtual_stages": "pp",
                "sequence_parallel": "tp"}
        for f, c in DEGREE_COLUMNS.items():
            blank = f in gate and held[gate[f]] == 1
            assert exported[eid][c] == ("" if blank else str(as_json[f])), (eid, c)
    by_cp = [r["id"] for r in q.list_experiments(engine, order_by="cp", descending=True, columns=["id"])]
    assert by_cp == sorted(listed, key=lambda i: (-listed[i]["cp"], -i))


def test_a_new_run_goes_into_an_upgraded_store_under_a_new_id(tmp_path):
    from tests.helpers.store_helpers import fake_result, spec

    copy, before = opened("s0007_step_time_8d72316", tmp_path)
    engine = open_db(f"sqlite:///{copy}")
    eid = q.submit_experiment(engine, spec("after the upgrade"))
    assert eid > max(k[0] for k in before["experiments"])
    q.claim_next(engine, "w")
    q.store_result(engine, eid, fake_result(spec("after the upgrade")))
    assert q.get_experiment(engine, eid)["result"] == fake_result(spec("after the upgrade"))


def test_a_kill_during_the_upgrade_leaves_the_store_as_the_old_version_wrote_it(tmp_path):
    import subprocess
    import sys

    copy, before = opened("s0007_step_time_8d72316", tmp_path)
    killer = ("import os, signal\nfrom db.migrations import audit\nfrom db.session import open_db\n"
              "real = audit.restamp\n"
              "def restamp(*a, **k):\n    real(*a, **k)\n    os.kill(os.getpid(), signal.SIGKILL)\n"
              f"audit.restamp = restamp\nopen_db({f'sqlite:///{copy}'!r})\n")
    done = subprocess.run([sys.executable, "-c", killer], cwd=Path(__file__).resolve().parents[2], capture_output=True)
    assert done.returncode == -9, done.stderr
    assert snapshot(copy) == before
    assert sqlite3.connect(copy).execute("SELECT version_num FROM alembic_version").fetchall() == [("0007",)]
    engine = open_db(f"sqlite:///{copy}")
    assert current_revision(engine) == head_revision()


def test_a_diverged_run_main_stored_before_issue_31_shows(tmp_path, capsys):
    """Issue 31 item 2: main (f5f41f2) stored the issue's fp16 / lr 10 run with its NaN losses as null; it reads as
    NaN."""
    copy, _ = opened("s0010_f5f41f2", tmp_path)
    engine = open_db(f"sqlite:///{copy}")
    (eid,) = [r["id"] for r in q.list_experiments(engine, tag="diverged")]
    row = q.get_experiment(engine, eid)
    assert row["diverged"] is True and row["result"].diverged_at is not None
    assert main(["show", str(eid), "--db", f"sqlite:///{copy}"]) == 0
    assert "diverged: yes: the loss is nan from step" in capsys.readouterr().out


# ---- specs an older version stored: read back as they are, never judged by today's rules for new specs ----------

SHAPE = ('"model":{"vocab_size":256,"d_model":64,"n_layers":2,"n_heads":4,"n_kv_heads":null,"ffn_hidden":null,'
         '"seq_len":32,"n_experts":0,"top_k":2%s},"train":{"global_batch":8,"micro_batch":2,"microbatches":2,"steps":2,'
         '"warmup_steps":1,"precision":"fp32","optimizer":"adamw","lr":0.001,"recompute":"none","seed":0},"parallel":'
         '{"strategy":"ddp","world_size":2,"dp":2,"tp":1,"pp":1,"ep":1,"sequence_parallel":false,"pp_schedule":"1f1b",'
         '"virtual_stages":1,"offload":"none"},"runtime":{"backend":"auto","device":"auto","nnodes":1,"node_rank":0,'
         '"rdzv_endpoint":null,"timeout_s":600.0}')
JAX_FAMILY = ',"norm":"layernorm","mlp":"gelu","positions":"learned","tie_embeddings":false,"bias":"qkv"'
OLD_SPECS = {  # the spec JSON those commits' own `submit` stored
    "tab\there": '{"name":"tab\\there",%s,"framework":"torch"}' % (SHAPE % ""),  # before 20519f9 (plain-text names)
    "esc\x1b[31mred": '{"name":"esc\\u001b[31mred",%s,"framework":"torch"}' % (SHAPE % ""),
    "jax qkv": '{"name":"jax qkv",%s,"framework":"jax"}' % (SHAPE % JAX_FAMILY),  # 20519f9, before the JAX family rule
}
GONE_FIELD = '{"name":"gone",%s,"framework":"torch"}' % (SHAPE % ',"retired_field":1')
"""A spec with a field this version does not have: it cannot be read, and must still list, show and fail."""


def stored(engine, spec_json: str, status: str = "failed") -> int:
    """A row as an older version left it: the columns of a spec, and that version's spec JSON."""
    from sqlalchemy import update

    from db.models import Experiment
    from tests.helpers.store_helpers import spec

    eid = q.submit_experiment(engine, spec("stand-in", world_size=2))
    with engine.begin() as c:
        c.execute(update(Experiment).where(Experiment.id == eid).values(
            spec_json=spec_json, status=status, name=json.loads(spec_json)["name"]))
    return eid


def test_a_spec_an_older_version_stored_reads_shows_and_is_refused_for_requeue_with_the_reason(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = open_db(url)
    ids = {name: stored(engine, text) for name, text in OLD_SPECS.items()}
    for name, eid in ids.items():
        row = q.get_experiment(engine, eid)
        assert row["spec_error"] is None and row["spec"].name == name and row["spec"].parallel.dp == 2
        assert main(["show", str(eid), "--db", url]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\t" not in out.split("spec:")[0] and '"name":' in out.split("spec:")[1]
        assert main(["show", str(eid), "--db", url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["spec"]["name"] == name
        with pytest.raises(ValueError, match=f"experiment {eid} cannot be re-queued: this version refuses its spec"):
            q.requeue_experiment(engine, eid)
        assert main(["requeue", str(eid), "--db", url]) == 1
        assert "cannot be re-queued" in capsys.readouterr().err
    assert "framework jax runs the GPT family only" in str(pytest.raises(ValueError, q.requeue_experiment, engine,
                                                                         ids["jax qkv"]).value)
    assert main(["list", "--db", url]) == 0 and "tab\\x09here" in capsys.readouterr().out


def test_a_spec_this_version_cannot_read_still_lists_and_shows_with_the_reason(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = open_db(url)
    eid = stored(engine, GONE_FIELD)
    row = q.get_experiment(engine, eid)
    assert row["spec"] is None and row["spec_json"] == GONE_FIELD
    assert row["spec_error"] == ("this run's spec cannot be read by this version: ValidationError: "
                                 "model.retired_field: Extra inputs are not permitted")
    assert main(["show", str(eid), "--db", url]) == 0
    out = capsys.readouterr().out
    assert f"spec_error: {row['spec_error']}" in out and '"retired_field":1' in out
    assert main(["show", str(eid), "--db", url, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["spec_error"] == row["spec_error"] and shown["spec"]["model"]["retired_field"] == 1
    assert main(["list", "--db", url]) == 0 and "gone" in capsys.readouterr().out
    assert main(["requeue", str(eid), "--db", url]) == 1
    assert "model.retired_field: Extra inputs are not permitted" in capsys.readouterr().err
    assert export_csv(engine).count("\r\n") == 2


@pytest.mark.heavy
def test_run_detail_shows_an_old_spec_and_one_it_cannot_read(tmp_path, monkeypatch):
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    url = f"sqlite:///{tmp_path / 'ui.db'}"
    monkeypatch.setenv("SHARDLAB_DB_URL", url)
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    st.cache_data.clear()
    engine = open_db(url)
    old, gone = stored(engine, OLD_SPECS["esc\x1b[31mred"]), stored(engine, GONE_FIELD)
    at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "app.py"), default_timeout=60).run()
    for eid in (old, gone):
        at.query_params["run"] = str(eid)
        at.switch_page("dashboard/pages/run_detail.py").run()
        assert not at.exception, [e.message for e in at.exception]
    assert any("cannot be read by this version: ValidationError: model.retired_field" in t.value for t in at.text)


@pytest.mark.heavy
def test_edit_as_new_says_why_a_spec_it_cannot_read_does_not_load(tmp_path, monkeypatch):
    """Before, Edit as new opened New experiment unchanged, without a word (and requeue's refusal points to it)."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    url = f"sqlite:///{tmp_path / 'ui.db'}"
    monkeypatch.setenv("SHARDLAB_DB_URL", url)
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    st.cache_data.clear()
    gone = stored(open_db(url), GONE_FIELD)
    at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "app.py"), default_timeout=60).run()
    at.switch_page("dashboard/pages/runs.py").run()
    at.multiselect(key="runs_selected").set_value([gone]).run()
    at.button(key="act_clone").click().run()
    assert not at.exception, [e.message for e in at.exception]
    assert [t.value for t in at.title] == ["Runs"], "the page stays: there is nothing to load"
    assert any(f"Run #{gone} cannot be loaded into the form" in w.value and "model.retired_field" in w.value
               for w in at.warning)


# ---- a schema error is not an outage ---------------------------------------------------------------------------

def conflicting_store(tmp_path: Path) -> str:
    """A store at 0008 where something else already holds the index name revision 0009 creates (a hand edit)."""
    url = f"sqlite:///{tmp_path / 'edited.db'}"
    engine = get_engine(url)
    upgrade(engine, "0008")
    with engine.begin() as c:
        c.exec_driver_sql("CREATE INDEX ix_calibrations_name ON experiments (name)")
    forget_engines()
    return url


def test_a_revision_that_fails_is_a_schema_error_naming_it_and_the_store_is_unchanged(tmp_path):
    url = conflicting_store(tmp_path)
    with pytest.raises(SchemaError) as e:
        init_db(get_engine(url))
    text = str(e.value)
    assert "revision 0008" in text and "revision 0009 (Issue 25: runs imported" in text
    assert "index ix_calibrations_name already exists" in text and "not an outage" in text
    assert current_revision(get_engine(url)) == "0008"


def test_list_and_worker_exit_2_on_a_schema_error_without_retrying(tmp_path, capsys):
    url = conflicting_store(tmp_path)
    assert main(["list", "--db", url]) == 2
    assert "revision 0009" in capsys.readouterr().err
    forget_engines()
    t0 = time.monotonic()
    assert main(["worker", "--once", "--db", url, "--runs-dir", str(tmp_path / "runs")]) == 2
    assert time.monotonic() - t0 < 20  # before: "store unavailable ...; retry 26 in 30.0 s", forever


def test_a_store_from_a_newer_version_is_refused_by_name(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'newer.db'}"
    engine = init_db(get_engine(url))
    with engine.begin() as c:
        c.exec_driver_sql("UPDATE alembic_version SET version_num = 'f00dfeed'")
    forget_engines()
    assert main(["list", "--db", url]) == 2
    err = capsys.readouterr().err
    assert "'f00dfeed'" in err and "a newer version wrote it" in err


def test_schema_errors_are_not_outages_but_locks_and_full_disks_are(tmp_path):
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    from backend.worker.store_guard import is_transient

    engine = init_db(get_engine(f"sqlite:///{tmp_path / 's.db'}"))
    with pytest.raises(OperationalError) as dup, engine.begin() as c:
        c.execute(text("ALTER TABLE experiments ADD COLUMN name TEXT"))
    assert "duplicate column name" in str(dup.value) and not is_transient(dup.value)
    holder = sqlite3.connect(tmp_path / "s.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    locked = sqlite3.connect(tmp_path / "s.db", timeout=0.1)
    try:
        with pytest.raises(sqlite3.OperationalError) as lock:
            locked.execute("BEGIN IMMEDIATE")
        assert is_transient(OperationalError("BEGIN", {}, lock.value))
    finally:
        holder.execute("ROLLBACK")


# ---- the same on PostgreSQL: the renumbered revisions' own code, run by both stores ---------------------------

OLD_REVISIONS = {  # a revision as it was before it was renumbered (its file, from git) -> today's revision it sat on
    "0004_calibrations.py": "0003", "0004_framework.py": "0003", "0007_step_time_predicted.py": "0006",
    "0009_context_parallel.py": "0008"}
OLD_ROW = ("INSERT INTO experiments (name, spec_json, strategy, world_size, dp, tp, pp, ep, zero_stage, schedule, "
           "microbatches, virtual_stages, sequence_parallel, d_model, n_layers, n_heads, n_kv_heads, ffn, seq_len, "
           "vocab, n_experts, top_k, global_batch, micro_batch, steps, precision, optimizer, recompute, status, "
           "cancel_requested, created_at, step_s_median) VALUES ('old run', :spec, 'ddp', 2, 2, 1, 1, 1, 0, '1f1b', "
           "2, 1, :no, 32, 2, 2, 2, 128, 16, 64, 0, 2, 4, 2, 2, 'fp32', 'adamw', 'none', 'ok', :no, "
           "'2026-01-02 03:04:05.000000', 0.5)")


def run_old_revision(engine, file: str) -> str:
    """Apply the old revision's own upgrade() and stamp the store with its id, as that build did."""
    import importlib.util

    from alembic.operations import Operations
    from sqlalchemy import text

    spec = importlib.util.spec_from_file_location(f"old_{file[:-3]}", STORES / "old_revisions" / file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with engine.begin() as conn:
        ctx = MigrationContext.configure(conn)
        with Operations.context(ctx):
            module.upgrade()
        conn.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": module.revision})
    return module.revision


@pytest.mark.parametrize("old", sorted(OLD_REVISIONS))
@pytest.mark.heavy
def test_a_store_stamped_by_a_renumbered_revision_upgrades_on_both_stores(store_urls, old):
    from sqlalchemy import text

    engine = get_engine(store_urls.url("old.db", blank=True))
    upgrade(engine, OLD_REVISIONS[old])
    with engine.begin() as c:
        c.execute(text(OLD_ROW), {"spec": '{"name": "old run", "parallel": {"world_size": 2}}', "no": False})
        c.execute(text("INSERT INTO experiment_tags (experiment_id, tag) VALUES (1, 'kept')"))
    stamp = run_old_revision(engine, old)
    assert current_revision(engine) == stamp
    init_db(engine)
    assert current_revision(engine) == head_revision()
    with engine.connect() as c:
        assert compare_metadata(MigrationContext.configure(c, opts={"compare_type": True}), Base.metadata) == []
    row = q.get_experiment(engine, 1)
    assert (row["name"], row["status"], row["step_s_median"], row["tags"]) == ("old run", "ok", 0.5, ["kept"])
    assert row["run_uid"] and row["kind"] == "measured" and row["framework"] == "torch" and row["cp"] == 1
