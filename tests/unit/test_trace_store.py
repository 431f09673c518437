"""A trace in the history: kind "traced", stored through store_result like a run, listed and labelled."""

from __future__ import annotations

import pytest

from backend.result import Status
from backend.spec import ExperimentSpec
from backend.trace.history import begin_trace, finish_trace, to_run_result
from dashboard import runs_view, trace_view
from db import queries
from db.session import open_db

SPEC = ExperimentSpec.model_validate({"model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 32,
                                                "vocab_size": 256},
                                      "train": {"global_batch": 8, "micro_batch": 2},
                                      "parallel": {"strategy": "zero3", "world_size": 4}})
MEM = {"params_bytes": 100, "grads_bytes": 100, "optimizer_bytes": 204, "activations_bytes": 1000, "other_bytes": 8,
       "peak_bytes": 1500}


def _trace(status: str = "ok") -> dict:
    rows = [{"rank": 0, "coords": {"dp": 0}, "traced": MEM, "predicted": MEM | {"activations_bytes": 980},
             "error_pct": {"params_bytes": 0.0, "activations_bytes": 2.04, "other_bytes": 0.0},
             "seconds": {"total": 3.0}, "max_rss_bytes": 300 << 20}] if status == "ok" else []
    fail = [] if status == "ok" else [{"rank": 0, "status": status,
                                       "error": "torch C++ code read a fake tensor's storage",
                                       "traceback": "Traceback ..."}]
    return {"status": status,
            "error": None if status == "ok" else "rank 0: torch C++ code read a fake tensor's storage",
            "spec": {}, "per_rank": rows, "seconds": 3.5, "notes": ["traced note"], "kind": "traced", "failures": fail}


def test_trace_is_stored_as_a_traced_run_and_listed(tmp_path) -> None:
    engine = open_db(f"sqlite:///{tmp_path / 'db.sqlite'}")
    eid = begin_trace(engine, SPEC)
    assert queries.get_status(engine, eid) == "running"
    finish_trace(engine, eid, SPEC, _trace())
    (row,) = queries.list_experiments(engine)
    assert row["kind"] == "traced" and row["status"] == "ok" and row["peak_bytes_max"] == 1500
    assert runs_view.run_label(row).endswith("· traced")
    res = queries.get_experiment(engine, eid)["result"]
    assert res.per_rank[0].measured.activations_bytes == 1000 and res.per_rank[0].predicted.activations_bytes == 980
    assert trace_view.is_traced(res) and "fake tensors" in trace_view.banner(res)


def test_unsupported_trace_is_a_failed_run_naming_the_limitation() -> None:
    res = to_run_result(SPEC, _trace("unsupported"))
    assert res.status == Status.FAILED and res.error.startswith("unsupported: rank 0: torch C++")
    assert res.failing_rank == 0 and res.per_rank == [] and res.model_extra["trace"]["status"] == "unsupported"


def test_measured_runs_default_to_kind_measured(tmp_path) -> None:
    engine = open_db(f"sqlite:///{tmp_path / 'db.sqlite'}")
    queries.submit_experiment(engine, SPEC)
    (row,) = queries.list_experiments(engine)
    assert row["kind"] == "measured" and not trace_view.is_traced(row=row)


def test_a_running_trace_is_not_taken_for_a_dead_workers_job(tmp_path) -> None:
    """A worker's recovery interrupts running rows whose heartbeat is missing or older than stale_after_s. A trace has
    no worker: before, its row had no heartbeat, so the next recovery round marked any trace 'interrupted: the worker
    stopped' while it was still tracing. The row starts with a heartbeat and beats while the trace runs."""
    import socket
    import time
    from datetime import timedelta

    from sqlalchemy import update

    from backend.trace.history import beating
    from backend.worker import recovery
    from db.models import Experiment, utcnow

    engine = open_db(f"sqlite:///{tmp_path / 'h.db'}")
    eid = begin_trace(engine, SPEC)
    assert recovery.recover(engine, tmp_path / "runs", socket.gethostname(), stale_after_s=60) == []
    assert queries.get_experiment(engine, eid)["status"] == "running"
    old = utcnow() - timedelta(minutes=5)
    with engine.begin() as c:  # a long trace: its first heartbeat is long past
        c.execute(update(Experiment).where(Experiment.id == eid).values(heartbeat_at=old))
    with beating(engine, eid, every_s=0.05):
        time.sleep(0.5)
        assert recovery.recover(engine, tmp_path / "runs", socket.gethostname(), stale_after_s=60) == []
    assert queries.get_experiment(engine, eid)["status"] == "running"


def test_a_trace_is_not_re_queued_as_a_real_run_of_its_full_size_spec(tmp_path) -> None:
    """Re-run on a trace queued a measured run (kind measured) of the traced, typically full-size, spec."""
    engine = open_db(f"sqlite:///{tmp_path / 'r.db'}")
    eid = begin_trace(engine, SPEC)
    finish_trace(engine, eid, SPEC, _trace())
    with pytest.raises(ValueError, match="is a trace .* trace it again instead"):
        queries.requeue_experiment(engine, eid)
    assert [r["id"] for r in queries.list_experiments(engine)] == [eid], "nothing was queued"


def test_beating_sets_its_event_once_the_rows_cancel_is_requested(tmp_path) -> None:
    import time

    from backend.trace.history import beating

    engine = open_db(f"sqlite:///{tmp_path / 'b.db'}")
    eid = begin_trace(engine, SPEC)
    with beating(engine, eid, every_s=0.05, poll_s=0.02) as cancel:
        time.sleep(0.1)
        assert not cancel.is_set()
        assert queries.cancel_experiment(engine, eid) == "cancelling"
        assert cancel.wait(2.0), "the heartbeat thread did not notice the cancel request"


def test_a_cancelled_trace_keeps_the_ranks_traced_before_and_is_stored_cancelled(tmp_path) -> None:
    """Between ranks: the rank that finished is kept, the later ones are not started, the row ends cancelled."""
    import threading

    from backend.trace.trace_spec import trace_spec

    cancel, started = threading.Event(), []

    def runner(spec_path, rank, out, timeout_s, device) -> dict:
        started.append(rank)
        cancel.set()  # the user cancels while rank 0 is traced; rank 0 still finishes
        return {"rank": rank, "status": "ok", "traced": MEM, "coords": {"dp": rank}}

    res = trace_spec(SPEC, ranks=[0, 1, 2], rank_runner=runner, cancel=cancel)
    assert started == [0] and [r["rank"] for r in res["per_rank"]] == [0] and res["failures"] == []
    assert res["status"] == "cancelled" and "ranks [0] traced and kept, ranks [1, 2] not traced" in res["error"]
    engine = open_db(f"sqlite:///{tmp_path / 'c.db'}")
    eid = begin_trace(engine, SPEC)
    finish_trace(engine, eid, SPEC, res)
    row = queries.get_experiment(engine, eid)
    assert row["status"] == "cancelled" and row["kind"] == "traced" and row["error"] == res["error"]
    assert row["world_size"] == 4 and [r.rank for r in row["result"].per_rank] == [0]


@pytest.mark.multiprocess  # the CLI as the dashboard starts it: a process of its own, each rank a child of it
@pytest.mark.slow
def test_cancel_stops_a_stored_trace_mid_rank_and_the_cli_exits_non_zero(tmp_path) -> None:
    """Cancel on a running trace set cancel_requested, but nothing read it: the trace went on through every rank and
    stored status ok. Now the rank being traced is stopped within seconds and the row ends cancelled."""
    import subprocess
    import sys
    import time

    from tests.helpers.launch import ROOT, rank_env

    url = f"sqlite:///{tmp_path / 't.db'}"
    (tmp_path / "s.json").write_text(SPEC.to_json())
    proc = subprocess.Popen([sys.executable, "-m", "backend", "trace", "--spec", str(tmp_path / "s.json"),
                             "--ranks", "0,1,2,3", "--store", "--db", url], cwd=ROOT, env=rank_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "tracing rank 0 (1/4)" in proc.stderr.readline()
        time.sleep(1.0)  # rank 0's process is running
        (row,) = queries.list_experiments(open_db(url))
        assert queries.cancel_experiment(open_db(url), row["id"]) == "cancelling"  # what the Runs page calls
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1 and f"trace of run {row['id']} cancelled: cancelled after" in err, err[-2000:]
    assert took < 10, f"the trace took {took:.1f} s to stop after the cancel"
    assert "tracing rank 1" not in err, "no rank starts after the cancel"
    done = queries.get_experiment(open_db(url), row["id"])
    assert done["status"] == "cancelled" and done["kind"] == "traced" and done["world_size"] == 4
    assert "no rank finished, ranks [0, 1, 2, 3] not traced" in done["error"]
