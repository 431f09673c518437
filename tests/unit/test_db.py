"""The experiment store on a real SQLite file and on a real PostgreSQL server (the `store_urls` fixture):
session tuning, queries, lifecycle, atomic result storage."""

from __future__ import annotations

from datetime import timedelta

import pytest
from sqlalchemy import func, select, update

from backend.result import Status
from db import queries as q
from db import result_rows
from db.models import CommRecord, Experiment, ExperimentTag, LossRecord, RankResultRow, TimelineRecord, utcnow
from db.session import DEFAULT_DB_PATH, get_engine, resolve_url, writer
from tests.helpers.store_helpers import fake_result, file_db, spec

NASTY = ["Robert'); DROP TABLE experiments;--", '"quoted"', "ünï©ødé 🚀", '=HYPERLINK("http://x.example","click")',
         "100%_done", "-1", "a,b;c d"]


@pytest.fixture
def engine(store_urls):
    return store_urls.engine()


def _count(engine, model) -> int:
    with engine.connect() as c:
        return c.execute(select(func.count()).select_from(model)).scalar_one()


def test_sqlite_is_tuned_for_a_worker_beside_readers(tmp_path):
    engine = file_db(tmp_path)
    with engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert c.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert c.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
        assert c.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 10_000
    assert get_engine(f"sqlite:///{tmp_path / 'store.db'}") is engine


def test_url_comes_from_argument_then_env_then_default(monkeypatch):
    monkeypatch.delenv("SHARDLAB_DB_URL", raising=False)
    assert resolve_url() == f"sqlite:///{DEFAULT_DB_PATH}"
    assert DEFAULT_DB_PATH.parts[-2:] == ("data", "shardlab.db")
    monkeypatch.setenv("SHARDLAB_DB_URL", "sqlite:////tmp/elsewhere.db")
    assert resolve_url() == "sqlite:////tmp/elsewhere.db"
    assert resolve_url("sqlite:////tmp/arg.db") == "sqlite:////tmp/arg.db"


def test_submit_and_get_round_trip_the_spec_and_filter_columns(engine):
    s = spec("first", strategy="zero2", world_size=2)
    eid = q.submit_experiment(engine, s, tags=["a", "b", "a", ""], sweep_id="sw1")
    row = q.get_experiment(engine, eid)
    assert row["spec"] == s and row["result"] is None
    assert row["tags"] == ["a", "b"] and row["sweep_id"] == "sw1"
    assert (row["status"], row["strategy"], row["zero_stage"], row["dp"],
            row["world_size"]) == ("queued", "zero2", 2, 2, 2)
    assert ((row["d_model"], row["n_layers"], row["seq_len"], row["ffn"], row["vocab"], row["microbatches"])
            == (32, 2, 16, 128, 64, 1))
    assert row["created_at"].tzinfo is not None
    assert set(q.ROW_KEYS) <= set(q.list_experiments(engine)[0])
    assert q.get_experiment(engine, eid + 100) is None


def test_filters_search_order_and_paging(engine):
    ids = [q.submit_experiment(engine, spec(f"run {chr(97 + i)}", strategy=st), tags=[f"t{i % 2}"],
                               sweep_id="sw" if i < 2 else None)
           for i, st in enumerate(["ddp", "zero1", "fsdp", "ddp"])]
    q.submit_experiment(engine, spec("100% done_x"))
    assert {r["id"] for r in q.list_experiments(engine, strategy="ddp")} == {ids[0], ids[3], ids[3] + 1}
    assert {r["id"] for r in q.list_experiments(engine, strategy=["zero1", "fsdp"])} == {ids[1], ids[2]}
    assert {r["id"] for r in q.list_experiments(engine, tag="t1")} == {ids[1], ids[3]}
    assert {r["id"] for r in q.list_experiments(engine, sweep_id="sw")} == {ids[0], ids[1]}
    assert [r["name"] for r in q.list_experiments(engine, search="100%")] == ["100% done_x"]
    assert q.list_experiments(engine, search="0%_") == []  # % and _ are literal, not wildcards
    assert [r["id"] for r in q.list_experiments(engine, search=str(ids[2]))] == [ids[2]]
    for text in ("99999999999999999999", "²"):  # too long for an id, a digit that is not a number: text only
        assert q.list_experiments(engine, search=text) == [] and q.count_experiments(engine, search=text) == 0
    assert [r["id"] for r in q.list_experiments(engine, order_by="id", descending=False, limit=2, offset=1)] == ids[1:3]
    assert q.count_experiments(engine) == 5 and q.count_experiments(engine, tag="t0", strategy="fsdp") == 1
    q.cancel_experiment(engine, ids[0])
    assert q.count_experiments(engine, status=["cancelled"]) == 1
    with pytest.raises(ValueError, match="not a column"):
        q.list_experiments(engine, order_by="name; DROP TABLE experiments")



def test_list_with_columns_reads_only_those_and_agrees_with_full_rows(engine):
    ids = [q.submit_experiment(engine, spec(f"r{i}", strategy=st), tags=["b", "a"] if i else [])
           for i, st in enumerate(["ddp", "pp", "fsdp"])]
    q.claim_next(engine, "w")
    q.store_result(engine, ids[0], fake_result(spec("r0"), "failed", seed=3))
    full = {r["id"]: r for r in q.list_experiments(engine)}
    lean = q.list_experiments(engine, columns=["status", "created_at", "tags", "peak_bytes_max"], order_by="id",
                              descending=False)
    assert [r["id"] for r in lean] == ids
    for r in lean:
        assert list(r) == ["id", "status", "created_at", "peak_bytes_max", "tags"]
        assert {k: full[r["id"]][k] for k in r} == r and r["created_at"].tzinfo is not None
    assert lean[0]["status"] == "failed" and lean[1]["tags"] == ["a", "b"] and lean[0]["tags"] == []
    no_tags = q.list_experiments(engine, columns=("name",), strategy="pp")
    assert no_tags == [{"id": ids[1], "name": "r1"}]
    with pytest.raises(ValueError, match="not experiment columns"):
        q.list_experiments(engine, columns=["name", "spec_json"])


def test_runs_table_from_its_columns_equals_the_table_from_full_rows(engine):
    from dashboard import runs_view as rv

    for i, st in enumerate(["ddp", "pp", "zero2"]):
        eid = q.submit_experiment(engine, spec(f"=n{i}" if i else "", strategy=st), tags=["x"] * i)
        if i < 2:
            q.claim_next(engine, "w")
            q.store_result(engine, eid, fake_result(spec(strategy=st), "ok" if i else "oom", seed=i))
    q.update_progress(engine, q.submit_experiment(engine, spec("live")), 1, 3, "timed")
    full = rv.table_frame(q.list_experiments(engine))
    assert full.equals(rv.table_frame(q.list_experiments(engine, columns=rv.TABLE_KEYS)))
    assert len(full) == 4 and full["peak (MiB)"].notna().sum() == 1 and "×pp2" in full["degrees"].iloc[2]

def test_claim_takes_the_oldest_queued_once(engine):
    a, b = q.submit_experiment(engine, spec("a")), q.submit_experiment(engine, spec("b"))
    assert q.claim_next(engine, "w1", host="h") == a
    assert q.claim_next(engine, "w2") == b
    assert q.claim_next(engine, "w3") is None
    row = q.get_experiment(engine, a)
    assert (row["status"], row["worker_id"], row["host"]) == ("running", "w1", "h")
    assert row["started_at"] is not None and row["heartbeat_at"] is not None


def test_heartbeat_updates_experiment_and_worker_in_one_call(engine, monkeypatch):
    from db import run_queue
    from db import workers as wk

    exp = q.submit_experiment(engine, spec())
    assert q.claim_next(engine, "w1") == exp
    q.register_worker(engine, "w1", pid=123, host="h", pid_started=None)
    writes = []
    real = run_queue.writer  # heartbeat is a queue transition (db/run_queue.py), re-exported by db.queries
    monkeypatch.setattr(run_queue, "writer", lambda e: writes.append(1) or real(e))
    assert q.heartbeat(engine, exp, worker_id="w1") is False
    assert len(writes) == 1  # one write transaction for both rows
    w = {r["id"]: r for r in q.worker_heartbeats(engine)}["w1"]
    assert (w["state"], w["experiment_id"]) == ("running", exp)
    # a worker already found dead is not re-examined on every start
    monkeypatch.setattr(wk, "_process_gone", lambda pid, started: True)
    assert q.recover_dead_workers(engine, "h") == [exp]
    monkeypatch.setattr(wk, "_process_gone", lambda pid, started: pytest.fail("dead worker re-checked"))
    assert q.recover_dead_workers(engine, "h") == []


def test_cancel_queued_is_immediate_and_running_is_requested(engine):
    queued, running = q.submit_experiment(engine, spec()), q.submit_experiment(engine, spec())
    assert q.claim_next(engine, "w") == queued
    assert q.cancel_experiment(engine, running) == "cancelled"
    assert q.claim_next(engine, "w") is None  # a cancelled row is never claimed
    assert q.update_progress(engine, queued, 1, 4, "timed") is False
    assert q.cancel_experiment(engine, queued) == "cancelling"
    assert q.get_status(engine, queued) == "running"
    assert q.update_progress(engine, queued, 2, 4, "timed") is True and q.heartbeat(engine, queued) is True
    row = q.get_experiment(engine, queued)
    assert (row["progress_step"], row["progress_total"], row["progress_phase"]) == (2, 4, "timed")
    q.store_result(engine, queued, fake_result(row["spec"], "cancelled"))
    assert q.cancel_experiment(engine, queued) == "cancelled"
    with pytest.raises(q.NotFound):
        q.cancel_experiment(engine, 999)


def test_requeue_clones_finished_runs_and_refuses_live_ones(engine):
    eid = q.submit_experiment(engine, spec("x"), tags=NASTY[:2], sweep_id="s")
    with pytest.raises(ValueError, match="is queued"):
        q.requeue_experiment(engine, eid)
    q.claim_next(engine, "w")
    with pytest.raises(ValueError, match="is running"):
        q.requeue_experiment(engine, eid)
    q.store_result(engine, eid, fake_result(spec("x"), "failed"))
    new = q.requeue_experiment(engine, eid)
    assert new != eid
    old_row, new_row = q.get_experiment(engine, eid), q.get_experiment(engine, new)
    assert old_row["status"] == "failed" and old_row["error"] == "rank 1 raised: boom 0"  # history kept
    assert (new_row["status"], new_row["requeue_of"], new_row["sweep_id"]) == ("queued", eid, "s")
    assert new_row["spec"] == old_row["spec"] and sorted(new_row["tags"]) == sorted(NASTY[:2])
    assert q.claim_next(engine, "w") == new


def test_store_result_fills_every_table(engine):
    s = spec("full")
    eid = q.submit_experiment(engine, s)
    q.claim_next(engine, "w")
    res = fake_result(s, seed=3)
    q.store_result(engine, eid, res)
    row = q.get_experiment(engine, eid)
    assert row["result"] == res and row["status"] == "ok" and row["finished_at"] is not None
    assert (row["step_s_median"], row["tokens_per_s"], row["bubble_measured"], row["bubble_predicted"]) == (
        res.step_s_median, res.tokens_per_s, res.bubble_measured, res.bubble_predicted)
    assert row["peak_bytes_max"] == max(r.measured.peak_bytes for r in res.per_rank)
    assert row["env"]["torch"] == "2.13.0+cpu"
    with engine.connect() as c:
        ranks = c.execute(select(RankResultRow.measured_activations_bytes, RankResultRow.step_s_median,
                                 RankResultRow.tokens_per_s_share).order_by(RankResultRow.rank)).all()
        assert [r.measured_activations_bytes for r in ranks] == [r.measured.activations_bytes for r in res.per_rank]
        assert ranks[1].step_s_median == sorted(res.per_rank[1].step_s)[1]
        assert ranks[1].tokens_per_s_share == pytest.approx(s.tokens_per_step / ranks[1].step_s_median / 2)
        comm = c.execute(select(CommRecord.rank, CommRecord.collective, CommRecord.bytes, CommRecord.predicted_bytes)
                         .order_by(CommRecord.rank, CommRecord.collective)).all()
        assert comm[0] == (0, "all_gather", None, 12.5)  # predicted but never called
        assert comm[1] == (0, "all_reduce", res.per_rank[0].comm["all_reduce"].bytes,
                           res.per_rank[0].comm_predicted["all_reduce"])
        assert (c.execute(select(LossRecord.step, LossRecord.loss, LossRecord.loss_reference)).all()
                == [(0, 4.5, 4.5), (1, 4.25, 4.2500001)])
        assert c.execute(select(TimelineRecord.pass_, TimelineRecord.end_s)).all() == [("F", 0.01), ("B", 0.03)]
    q.store_result(engine, eid, res)  # storing again replaces, never duplicates
    assert _count(engine, RankResultRow) == 2 and _count(engine, LossRecord) == 2 and _count(engine, CommRecord) == 6


def test_failed_runs_are_results_with_nothing_measured(engine):
    s = spec()
    eid = q.submit_experiment(engine, s)
    q.claim_next(engine, "w")
    q.store_result(engine, eid, fake_result(s, "oom"))
    row = q.get_experiment(engine, eid)
    assert (row["status"], row["failing_rank"], row["log_tail"]) == ("oom", 1, "line 1\nline 2")
    assert row["peak_bytes_max"] is None
    with engine.connect() as c:
        got = c.execute(select(RankResultRow.measured_peak_bytes, RankResultRow.predicted_peak_bytes)).all()
    assert [g[0] for g in got] == [None, None] and all(g[1] > 0 for g in got)


@pytest.mark.heavy
def test_store_result_is_all_or_nothing(engine, monkeypatch):
    s = spec()
    eid = q.submit_experiment(engine, s)
    q.claim_next(engine, "w")

    def broken(*_a, **_k):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(result_rows, "timeline_rows", broken)
    with pytest.raises(RuntimeError):
        q.store_result(engine, eid, fake_result(s))
    assert q.get_status(engine, eid) == "running"
    assert _count(engine, RankResultRow) == 0 and _count(engine, CommRecord) == 0 and _count(engine, LossRecord) == 0


def test_delete_cascades_and_refuses_running(engine):
    s = spec()
    eid = q.submit_experiment(engine, s, tags=["x"])
    q.claim_next(engine, "w")
    with pytest.raises(ValueError, match="cancel it"):
        q.delete_experiment(engine, eid)
    q.store_result(engine, eid, fake_result(s))
    q.delete_experiment(engine, eid)
    for model in (Experiment, ExperimentTag, RankResultRow, CommRecord, LossRecord, TimelineRecord):
        assert _count(engine, model) == 0, model


def test_recover_stale_interrupts_only_silent_running_jobs(engine):
    old, fresh, queued = (q.submit_experiment(engine, spec()) for _ in range(3))
    q.claim_next(engine, "w1"), q.claim_next(engine, "w2")
    with writer(engine) as s, s.begin():
        s.execute(update(Experiment).where(Experiment.id == old).values(heartbeat_at=utcnow() - timedelta(minutes=10)))
    assert q.recover_stale(engine, 60) == [old]
    row = q.get_experiment(engine, old)
    assert row["status"] == "interrupted" and "heartbeat" in row["error"]
    assert q.get_status(engine, fresh) == "running" and q.get_status(engine, queued) == "queued"
    assert q.requeue_experiment(engine, old) > queued


def test_tags_and_names_with_sql_quotes_and_unicode_are_verbatim(engine):
    eids = [q.submit_experiment(engine, spec(name), tags=[name, "plain"]) for name in NASTY]
    for name, eid in zip(NASTY, eids, strict=False):
        row = q.get_experiment(engine, eid)
        assert row["name"] == name and sorted(row["tags"]) == sorted([name, "plain"])
        assert [r["id"] for r in q.list_experiments(engine, tag=name)] == [eid]
    assert q.set_tags(engine, eids[0], [NASTY[2], NASTY[2]]) == [NASTY[2]]
    assert q.get_experiment(engine, eids[0])["tags"] == [NASTY[2]]
    assert q.count_experiments(engine) == len(NASTY)
    assert {r["name"] for r in q.list_experiments(engine, search="DROP TABLE")} == {NASTY[0]}


def test_worker_rows_report_state_and_age(engine):
    q.register_worker(engine, "h:1:0", pid=1, host="h", pid_started=None)
    q.set_worker_state(engine, "h:1:0", "running", 5)
    (w,) = q.worker_heartbeats(engine)
    assert (w["id"], w["state"], w["experiment_id"], w["alive"]) == ("h:1:0", "running", 5, True) and w["age_s"] >= 0
    q.set_worker_state(engine, "h:1:0", "stopped")
    assert q.worker_heartbeats(engine)[0]["alive"] is False


def test_dead_local_worker_jobs_are_interrupted_at_once(engine):
    eid = q.submit_experiment(engine, spec())
    q.register_worker(engine, "h:999999:0", pid=2**22 + 12345, host="h", pid_started=1.0)
    q.claim_next(engine, "h:999999:0", host="h")
    assert q.recover_dead_workers(engine, "other-host") == []
    assert q.recover_dead_workers(engine, "h") == [eid]
    assert q.get_status(engine, eid) == Status.INTERRUPTED
