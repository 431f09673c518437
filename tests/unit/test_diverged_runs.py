"""Issue 31 item 2: a diverged run (NaN / inf losses) is stored, shown with a "diverged" mark and exported, on both
stores; a row whose stored result does not read never breaks `list`, `show`, the Runs page or the export. The
issue's own steps (fp16-mixed, lr 10, real ranks): tests/multiprocess/test_diverged_run.py."""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import pytest

from backend.cli import main
from backend.engine.accuracy_notes import divergence_notes, loss_parity
from backend.result import RunResult
from db import queries as q
from db.export import export_csv, export_json
from db.session import open_db
from tests.helpers.store_helpers import fake_result, spec

NAN, INF = math.nan, math.inf
LOSSES = [5.5, NAN, INF, -INF, NAN]
REPO = Path(__file__).resolve().parents[2]


def same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b, strict=False))


def diverged_result(name: str = "diverged") -> RunResult:
    result = fake_result(spec(name))
    result.loss, result.loss_reference = list(LOSSES), [5.5, NAN, INF, -INF, NAN]
    result.loss_max_abs_diff = loss_parity(result.loss, result.loss_reference)
    result.notes = divergence_notes(result.loss, result.loss_reference)
    return result


def strict_json(text: str):
    """JSON as a strict parser reads it: a bare NaN / Infinity token is an error."""
    def refuse(token: str):
        raise ValueError(f"non-standard JSON token {token}")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_losses_survive_result_json():
    result = diverged_result()
    text = result.to_json()
    assert strict_json(text)["loss"] == [5.5, "NaN", "Infinity", "-Infinity", "NaN"]
    back = RunResult.from_json(text)
    assert same(back.loss, LOSSES) and back.diverged_at == 1 and back.to_json() == text
    assert back.divergence() == "the loss is nan from step 2 of 5 on (4 steps not finite)"
    one = RunResult.from_json(fake_result(spec("one")).to_json())
    one.loss = [1.0, INF]
    assert one.divergence() == "the loss is inf from step 2 of 2 on (1 step not finite)"


def test_a_loss_an_older_version_wrote_as_null_reads_as_nan():
    data = json.loads(fake_result(spec("old")).to_json())
    data["loss"], data["loss_reference"] = [5.5, None, None], [5.5, None, None]  # what pydantic's default wrote
    back = RunResult.model_validate_json(json.dumps(data))
    assert same(back.loss, [5.5, NAN, NAN]) and back.diverged_at == 1


def test_loss_parity_and_the_note_of_a_diverged_run():
    assert loss_parity([1.0, NAN, INF], [1.0 + 1e-7, NAN, INF]) == pytest.approx(1e-7)  # diverged alike: parity holds
    assert loss_parity([1.0, NAN], [1.0, 2.0]) == INF  # only one of them diverged
    assert loss_parity([1.0, 2.0], [1.5, 2.0]) == 0.5 and loss_parity([], [1.0]) is None
    (note,) = divergence_notes([5.5, NAN, NAN], [5.5, NAN, NAN])
    assert note.startswith("DIVERGED: the loss is nan from step 2 of 3 on (2 of 3 steps not finite)")
    assert "reference diverged at the same step" in note and divergence_notes([1.0], [1.0]) == []


def test_a_diverged_run_is_stored_listed_shown_and_exported(store_urls, capsys):
    engine = store_urls.engine()
    fine = q.submit_experiment(engine, spec("fine"))
    q.claim_next(engine, "w")
    q.store_result(engine, fine, fake_result(spec("fine")))
    eid = q.submit_experiment(engine, spec("diverged"))
    q.claim_next(engine, "w")
    q.store_result(engine, eid, diverged_result())
    row = q.get_experiment(engine, eid)
    assert row["status"] == "ok" and row["diverged"] is True and row["result_error"] is None
    assert same(row["result"].loss, LOSSES) and same(row["result"].loss_reference, LOSSES)
    assert {r["id"]: r["diverged"] for r in q.list_experiments(engine)} == {fine: False, eid: True}

    exported = {r["id"]: r for r in csv.DictReader(io.StringIO(export_csv(engine)))}
    assert (exported[str(eid)]["diverged"], exported[str(fine)]["diverged"]) == ("True", "False")
    for long in (False, True):
        assert str(eid) in export_csv(engine, long=long)
    runs = {r["id"]: r for r in strict_json(export_json(engine))}
    assert runs[eid]["result"]["loss"] == [5.5, "NaN", "Infinity", "-Infinity", "NaN"]

    url = store_urls.url()
    assert main(["list", "--db", url]) == 0
    listed = capsys.readouterr().out
    assert f"{eid} ok diverged" in listed.replace("  ", " ") and f"{fine} ok " in listed
    assert main(["show", str(eid), "--db", url]) == 0
    assert "diverged: yes: the loss is nan from step 2 of 5 on (4 steps not finite)" in capsys.readouterr().out
    assert main(["show", str(eid), "--db", url, "--json"]) == 0
    shown = strict_json(capsys.readouterr().out)
    assert shown["diverged"] is True and shown["result"]["loss"][1:3] == ["NaN", "Infinity"]
    assert main(["export", "--db", url, "--format", "json"]) == 0
    assert strict_json(capsys.readouterr().out)[-1]["id"] == eid


def test_a_row_whose_result_does_not_read_breaks_nothing(tmp_path, capsys):

    from dashboard.runs_view import table_frame

    url = f"sqlite:///{tmp_path / 'store.db'}"
    engine = open_db(url)
    eid = q.submit_experiment(engine, spec("garbled"))
    q.claim_next(engine, "w")
    q.store_result(engine, eid, fake_result(spec("garbled")))
    with engine.begin() as c:  # a result this version cannot read (a field of the wrong type)
        c.exec_driver_sql("UPDATE experiments SET result_json = replace(result_json, '\"wall_s\":12.5', "
                          "'\"wall_s\":\"x\"')")
    row = q.get_experiment(engine, eid)
    assert row["result"] is None and "wall_s" in row["result_error"]
    assert main(["show", str(eid), "--db", url]) == 0
    assert "result: the stored result does not read" in capsys.readouterr().out
    assert main(["list", "--db", url]) == 0 and main(["export", "--db", url]) == 0
    assert table_frame(q.list_experiments(engine))["status"].tolist() == ["ok"]


def test_the_runs_page_and_run_detail_mark_a_diverged_run(tmp_path, monkeypatch):
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from dashboard.runs_view import table_frame

    url = f"sqlite:///{tmp_path / 'ui.db'}"
    monkeypatch.setenv("SHARDLAB_DB_URL", url)
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    st.cache_data.clear()
    engine = open_db(url)
    eid = q.submit_experiment(engine, spec("diverged"))
    q.claim_next(engine, "w")
    q.store_result(engine, eid, diverged_result())
    assert table_frame(q.list_experiments(engine))["status"].tolist() == ["ok, diverged"]
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=60).run()
    at.switch_page("dashboard/pages/runs.py").run()
    assert not at.exception, [e.message for e in at.exception]
    at.query_params["run"] = str(eid)
    at.switch_page("dashboard/pages/run_detail.py").run()
    assert not at.exception, [e.message for e in at.exception]
    warnings = [str(w.value) for w in at.warning]
    assert any(w.startswith("Diverged: the loss is nan from step 2 of 5 on") for w in warnings), warnings


def test_an_imported_run_with_an_inf_loss_is_stored_and_shown(store_urls, capsys):
    """Whatever a log parser hands over (issue 31: `lm loss: inf` in a Megatron log), the store and `show` keep it."""
    engine = store_urls.engine()
    result = fake_result(spec("imported"))
    result.loss, result.loss_reference = [9.5, 8.9, INF, NAN], []
    eid = q.store_finished_run(engine, result, kind="imported")
    row = q.get_experiment(engine, eid)
    assert row["kind"] == "imported" and row["diverged"] is True and same(row["result"].loss, [9.5, 8.9, INF, NAN])
    assert main(["show", str(eid), "--db", store_urls.url()]) == 0
    assert "diverged: yes: the loss is inf from step 3 of 4 on (2 steps not finite)" in capsys.readouterr().out
