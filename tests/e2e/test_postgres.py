"""What only PostgreSQL needs checking: claims skip rows another transaction holds (FOR UPDATE SKIP LOCKED,
not SQLite's BEGIN IMMEDIATE), two processes migrating one fresh database at once, the dashboard on a
PostgreSQL URL, and the 10,000-run export giving the same CSV and JSON on both backends. The rest of the
store, worker, CLI, export and migration suites run on both backends through the `store_urls` fixture."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from sqlalchemy import select, text

from db import queries as q
from db.migrations import current_revision, head_revision
from db.models import Experiment
from db.session import REPO, get_engine, open_db, reader
from tests.helpers.store_helpers import spec

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg(pg_server):
    dbs = []

    def new(blank: bool = False) -> str:
        dbs.append(pg_server.new_database(blank=blank))
        return pg_server.url(dbs[-1])

    yield new
    from db.session import forget_engines

    forget_engines()
    for db in dbs:
        pg_server.drop_database(db)


def test_the_engine_is_postgres_and_claims_skip_rows_held_by_another_transaction(pg):
    engine = open_db(pg())
    assert engine.dialect.name == "postgresql" and current_revision(engine) == head_revision()
    first, second = q.submit_experiments(engine, [spec("a"), spec("b")])
    with reader(engine) as s, s.begin():
        # another worker mid-claim: it holds the oldest queued row
        s.execute(select(Experiment.id).where(Experiment.id == first).with_for_update())
        t0 = time.monotonic()
        took = q.claim_next(engine, "w2")
        waited_s = time.monotonic() - t0
    assert took == second and waited_s < 5, (took, waited_s)  # skipped, not blocked until the holder commits
    assert q.claim_next(engine, "w3") == first and q.claim_next(engine, "w4") is None


OPENER = """
import time, pathlib
from db.session import open_db
from db.migrations import current_revision
go = pathlib.Path({go!r})
while not go.exists():
    time.sleep(0.005)
print(current_revision(open_db({url!r})))
"""


def test_two_processes_opening_a_fresh_database_migrate_it_once(pg, tmp_path):
    url = pg(blank=True)
    go = tmp_path / "go"
    script = OPENER.format(url=url, go=str(go))
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
             for _ in range(2)]
    time.sleep(2.0)
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    assert [o.strip() for o, _ in outs] == [head_revision()] * 2
    with get_engine(url).connect() as c:
        assert c.execute(text("SELECT count(*) FROM alembic_version")).scalar_one() == 1


def test_the_dashboard_submits_lists_and_cancels_on_postgres(pg, monkeypatch):
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    url = pg()
    monkeypatch.setenv("SHARDLAB_DB_URL", url)
    st.cache_data.clear()
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=60).run()
    at.text_input(key="f_name").set_value("on pg; $(rm -rf /)")
    at.text_input(key="submit_tags").set_value("team, `id`")
    at.button(key="submit_one").click()
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    engine = open_db(url)
    (row,) = q.list_experiments(engine)
    assert row["name"] == "on pg; $(rm -rf /)" and row["tags"] == ["`id`", "team"] and row["status"] == "queued"
    at.switch_page("dashboard/pages/runs.py").run()
    assert not at.exception and list(at.dataframe[0].value["id"]) == [row["id"]]
    at.multiselect(key="runs_selected").set_value([row["id"]]).run()
    at.button(key="act_cancel").click()
    at.run()
    assert not at.exception and q.get_status(engine, row["id"]) == "cancelled"


def copy_store(src, dst) -> None:
    """Every table of the SQLite store `src` into the PostgreSQL store `dst` with COPY (seconds for ~300k rows,
    where row-by-row inserts take minutes here): the export then reads the same rows from both backends."""
    from db.models import Base

    with src.connect() as s, dst.connect() as d:
        raw = d.connection.driver_connection
        cur = raw.cursor()
        for table in Base.metadata.sorted_tables:
            cols = [c.name for c in table.columns]
            rows = s.exec_driver_sql(f"SELECT {', '.join(cols)} FROM {table.name}").all()
            with cur.copy(f"COPY {table.name} ({', '.join(cols)}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
        raw.commit()


@pytest.mark.slow
def test_10000_run_export_is_the_same_on_sqlite_and_postgres(pg, tmp_path):
    from benchmarks.export_bench import fill
    from db.export import export_csv, export_json

    n = 10_000
    sqlite, postgres = open_db(f"sqlite:///{tmp_path / 'big.db'}"), open_db(pg())
    t0 = time.perf_counter()
    fill(sqlite, n)
    t1 = time.perf_counter()
    copy_store(sqlite, postgres)
    t2 = time.perf_counter()
    print(f"filled {n} runs into SQLite in {t1 - t0:.1f} s, copied to PostgreSQL in {t2 - t1:.1f} s")
    assert q.count_experiments(postgres) == q.count_experiments(sqlite) == n
    # (the long CSV's PostgreSQL path is checked cell by cell on small stores in test_export.py)
    for label, export in (("wide CSV", export_csv), ("JSON", export_json)):
        t0 = time.perf_counter()
        on_sqlite = export(sqlite)
        t1 = time.perf_counter()
        on_postgres = export(postgres)
        print(f"{label}: SQLite {t1 - t0:.2f} s, PostgreSQL {time.perf_counter() - t1:.2f} s, "
              f"{len(on_sqlite) / 1e6:.1f} MB")
        assert on_postgres == on_sqlite, label
    assert on_sqlite.count('"id":') >= n
