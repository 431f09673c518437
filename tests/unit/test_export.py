"""CSV/JSON export: exactly the stored values, formula injection neutralised, numbers kept numbers."""

from __future__ import annotations

import csv
import io
import json

import pytest
from sqlalchemy import select, update

from backend.spec import ExperimentSpec
from db import queries as q
from db.export import LONG_HEADER, WIDE_HEADER, export_csv, export_json, neutralise, table
from db.models import Experiment, ExperimentTag
from tests.helpers.store_helpers import fake_result, spec

EVIL_NAME = '=HYPERLINK("http://evil.example","click")'
TAGS = ["Robert'); DROP TABLE experiments;--", '"quoted"', "ünï©ødé 🚀", "+cmd|' /C calc'!A0", "@SUM(1)"]


@pytest.fixture
def stored(store_urls):
    engine = store_urls.engine()
    ids = {}
    for i, (name, status) in enumerate([(EVIL_NAME, "ok"), ("-negative name", "failed"), ("plain", "ok")]):
        s = spec(name, strategy="zero1" if i == 1 else "ddp")
        eid = q.submit_experiment(engine, s, tags=TAGS if i == 0 else ["TAB"])
        q.claim_next(engine, "w")
        res = fake_result(s, status, seed=i + 1)
        q.store_result(engine, eid, res)
        ids[eid] = res
    queued = q.submit_experiment(engine, spec("queued"))
    ids[queued] = None
    # Control characters are refused at submit since issue 21; rows stored before that may still hold them, and
    # the export must neutralise them: written straight into the tables, as an older version stored them.
    with engine.begin() as c:
        c.execute(update(ExperimentTag).where(ExperimentTag.tag == "TAB").values(tag="\tTAB"))
        c.execute(update(Experiment).where(Experiment.id == queued).values(name="\rqueued"))
    return engine, ids


def _rows(text: str) -> list[dict]:
    return list(csv.DictReader(io.StringIO(text)))


def test_neutralise_only_text():
    assert neutralise("=1+1") == "'=1+1" and neutralise("-x") == "'-x" and neutralise("\tx") == "'\tx"
    assert neutralise("\rx") == "'\rx" and neutralise("@x") == "'@x" and neutralise("+x") == "'+x"
    assert (neutralise(-1.5) == -1.5 and neutralise(-3) == -3 and neutralise("safe") == "safe"
            and neutralise(None) is None)


def test_wide_csv_holds_the_stored_values(stored):
    engine, ids = stored
    rows = _rows(export_csv(engine))
    assert list(rows[0]) == WIDE_HEADER and len(rows) == len(ids)
    by_id = {int(r["id"]): r for r in rows}
    for eid, res in ids.items():
        r = by_id[eid]
        if res is None:
            assert r["status"] == "queued" and r["measured_peak_bytes"] == "" and r["name"] == "'\rqueued"
            continue
        assert r["status"] == str(res.status) and r["strategy"] == str(res.spec.parallel.strategy)
        assert (int(r["world_size"]) == 2 and int(r["d_model"]) == 32
                and int(r["zero_stage"]) == res.spec.parallel.zero_stage)
        assert int(r["predicted_peak_bytes"]) == max(x.predicted.peak_bytes for x in res.per_rank)
        assert float(r["step_s_median"]) == res.step_s_median and float(r["tokens_per_s"]) == res.tokens_per_s
        assert float(r["bubble_measured"]) == res.bubble_measured  # -0.015625 stays a number for seed 1
        assert r["torch_version"] == "2.13.0+cpu" and r["python_version"] == "3.11.9"
        comm_max = max(sum(c.bytes for c in x.comm.values()) for x in res.per_rank)
        assert float(r["comm_bytes"]) == comm_max
        assert float(r["comm_all_reduce_bytes"]) == max(x.comm["all_reduce"].bytes for x in res.per_rank)
        if res.status == "ok":
            m = max(x.measured.activations_bytes for x in res.per_rank)
            p = max(x.predicted.activations_bytes for x in res.per_rank)
            assert int(r["measured_activations_bytes"]) == m
            assert float(r["error_pct_activations"]) == pytest.approx((m - p) / p * 100)
        else:
            assert r["measured_peak_bytes"] == "" and r["error"] == res.error and int(r["failing_rank"]) == 1
    negative = [r for r in rows if r["bubble_measured"].startswith("-")]
    assert negative and all(float(r["bubble_measured"]) < 0 for r in negative)


def test_csv_neutralises_formulas_but_keeps_text_verbatim(stored):
    engine, _ = stored
    rows = _rows(export_csv(engine))
    names = {r["name"] for r in rows}
    assert "'" + EVIL_NAME in names and "'-negative name" in names and "plain" in names
    first = next(r for r in rows if r["name"] == "'" + EVIL_NAME)
    assert sorted(json.loads(first["tags"])) == sorted(TAGS)
    tab = next(r for r in rows if r["name"] == "plain")
    assert json.loads(tab["tags"]) == ["\tTAB"]
    for r in rows:
        for k, v in r.items():
            assert not v.startswith(("=", "+", "@", "\t", "\r")), (k, v)
            if v.startswith("-"):
                float(v)  # only numbers may start with a minus


def test_long_csv_has_one_row_per_rank(stored):
    engine, ids = stored
    rows = _rows(export_csv(engine, long=True))
    assert list(rows[0]) == LONG_HEADER
    finished = [eid for eid, res in ids.items() if res is not None]
    assert len(rows) == 2 * len(finished) + 1  # the queued one keeps a single row without rank
    for eid in finished:
        res = ids[eid]
        mine = sorted((r for r in rows if int(r["id"]) == eid), key=lambda r: int(r["rank"]))
        assert [int(r["rank"]) for r in mine] == [0, 1]
        for r, rank in zip(mine, res.per_rank, strict=False):
            assert int(r["predicted_optimizer_bytes"]) == rank.predicted.optimizer_bytes
            assert float(r["comm_all_reduce_bytes"]) == rank.comm["all_reduce"].bytes
            assert float(r["comm_seconds"]) == pytest.approx(sum(c.seconds for c in rank.comm.values()))
            assert float(r["rank_step_s_max"]) == max(rank.step_s) and int(r["rss_bytes"]) == rank.rss_bytes
            assert json.loads(r["coords"]) == rank.coords



def _reference_csv(engine, long: bool, **filters) -> str:
    """The CSV from table() (one SQL join, raw values) with the guard applied cell by cell in Python."""
    header, rows = table(engine, long=long, **filters)
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(header)
    for d in rows:  # tags (a JSON list) where the header has them: after the identifying columns
        w.writerow([(json.dumps(d["tags"], ensure_ascii=False) if d["tags"] else None) if k == "tags"
                    else neutralise(d[k]) for k in header])
    return buf.getvalue()


@pytest.mark.parametrize("filters", [{}, {"status": "ok"}, {"tag": TAGS[0]}, {"search": "queued"},
                                     {"strategy": "nothing"}])
@pytest.mark.heavy
def test_csv_equals_the_cell_by_cell_reference(stored, filters):
    """export_csv guards text in SQL and, for the long CSV, formats each experiment's cells once for all its
    ranks: byte for byte what the straightforward join + Python guard gives, CR/LF and commas included."""
    engine, _ = stored
    s = spec("a,b =c")
    eid = q.submit_experiment(engine, s, tags=["x y", "=t"], sweep_id="-sw")
    q.store_result(engine, eid, fake_result(s, "ok", seed=7))
    with engine.begin() as c:  # CR/LF in text: only in rows stored before issue 21's text rules (see `stored`)
        c.execute(update(Experiment).where(Experiment.id == eid).values(name="a,b\r\n=c"))
        c.execute(update(ExperimentTag).where(ExperimentTag.experiment_id == eid, ExperimentTag.tag == "x y")
                  .values(tag="x\ny"))
    for long in (False, True):
        text = export_csv(engine, long=long, **filters)
        assert text == _reference_csv(engine, long, **filters)
        out = io.StringIO()
        assert export_csv(engine, out, long=long, **filters) is None and out.getvalue() == text
    if not filters:
        (mine,) = [r for r in _rows(export_csv(engine)) if r["id"] == str(eid)]
        assert mine["name"] == "a,b\r\n=c" and mine["sweep_id"] == "'-sw" and mine["status"] == "ok"
        assert mine["created_at"].endswith("+00:00") and "T" in mine["created_at"]


def test_table_gives_raw_values_and_iso_times(stored):
    engine, ids = stored
    header, rows = table(engine, long=True)
    assert header == LONG_HEADER and {r["id"] for r in rows} == set(ids)
    evil = next(r for r in rows if r["name"] == EVIL_NAME)  # raw: no quote prefix
    assert evil["created_at"].endswith("+00:00") and evil["created_at"].count("+00:00") == 1
    assert evil["rank"] in (0, 1) and isinstance(evil["predicted_peak_bytes"], int)

def test_export_filters_match_list_experiments(stored):
    engine, _ = stored
    assert {int(r["id"]) for r in _rows(export_csv(engine, strategy="zero1"))} == {
        r["id"] for r in q.list_experiments(engine, strategy="zero1")}
    assert {int(r["id"]) for r in _rows(export_csv(engine, status=["queued"]))} == {
        r["id"] for r in q.list_experiments(engine, status="queued")}
    assert ([x["id"] for x in json.loads(export_json(engine, tag=TAGS[0]))]
            == [r["id"] for r in q.list_experiments(engine, tag=TAGS[0])])


def test_json_export_is_the_full_stored_result(stored):
    engine, ids = stored
    data = json.loads(export_json(engine))
    assert [d["id"] for d in data] == sorted(ids)
    for d in data:
        res = ids[d["id"]]
        if res is None:
            assert d["result"] is None and d["status"] == "queued" and d["name"] == "\rqueued"
            continue
        assert d["result"] == json.loads(res.model_dump_json(by_alias=True))
        assert d["spec"] == json.loads(res.spec.model_dump_json())
        assert d["env"]["torch"] == "2.13.0+cpu"
    first = data[0]
    assert first["name"] == EVIL_NAME and sorted(first["tags"]) == sorted(TAGS)  # JSON is verbatim: no prefix
    buf = io.StringIO()
    assert export_json(engine, buf) is None and json.loads(buf.getvalue()) == data


def test_identifying_columns_first_blank_fields_and_the_predicted_step_time(store_urls):
    """Issue 20 item 13: id, name, status, kind, framework, strategy and the degrees lead (tags after them, not first);
    fields that do not apply are blank (no schedule=1f1b without a pipeline); step_time_predicted_s is exported."""
    from db.export import EXP_COLUMNS

    engine = store_urls.engine()
    dense, pp = spec("dense"), spec("pp", strategy="pp", pp_schedule="gpipe")
    ids = {}
    for s, predicted in ((dense, 0.42), (pp, None)):
        ids[s.name] = q.submit_experiment(engine, s, tags=["t"])
        res = fake_result(s)
        res.step_time_predicted_s = predicted
        q.store_result(engine, ids[s.name], res)
    text = export_csv(engine)
    header = next(csv.reader(io.StringIO(text)))
    # issue 34: the stack the run trains with (from the stored spec) sits with the framework
    assert header[:12] == ["id", "name", "status", "kind", "framework", "stack", "strategy", "world_size", "dp", "tp",
                           "pp", "ep"]
    assert header.index("tags") < header.index("d_model") and header[0] != "tags"
    old_names = {k for k in q.ROW_KEYS if k not in ("cancel_requested", "progress_step", "progress_total",
                                                    "progress_phase", "heartbeat_at", "peak_bytes_max")}
    assert old_names | {"tags"} <= set(header) and header.count("tags") == 1  # every existing column name kept
    assert header.index("step_time_predicted_s") == header.index("step_s_median") + 1
    # issue 30: the step-time error beside the prediction, and the loss parity verdict beside its difference;
    # issue 34: the stack
    # issue 35: the MoE capacity factor and the token-slots it dropped (from the stored spec / result JSON); the MoE
    # dispatcher (from the stored spec); why a stored result JSON does not parse (result_error)
    assert set(EXP_COLUMNS) - old_names == {"step_time_predicted_s", "step_time_error_pct", "loss_parity", "stack",
                                            "capacity_factor", "moe_dispatcher", "tokens_dropped", "result_error"}
    rows = {r["name"]: r for r in _rows(text)}
    assert {k: rows["dense"][k] for k in ("schedule", "virtual_stages", "sequence_parallel", "top_k")} == dict.fromkeys(
        ("schedule", "virtual_stages", "sequence_parallel", "top_k"), "")
    assert (rows["pp"]["schedule"], rows["pp"]["virtual_stages"]) == ("gpipe", "1")
    assert float(rows["dense"]["step_time_predicted_s"]) == 0.42 and rows["pp"]["step_time_predicted_s"] == ""
    assert rows["dense"]["stack"] == rows["pp"]["stack"] == "shardlab"
    for long in (False, True):  # the long CSV and table() agree
        assert export_csv(engine, long=long) == _reference_csv(engine, long)


def test_a_cpu_run_carries_its_predicted_step_time(tmp_path, monkeypatch):
    from backend.launch.launcher import predicted_step_s
    from backend.result import RunResult

    s = spec("cpu run")
    res = RunResult(status="ok", spec=s, env={"device": "cpu"})
    monkeypatch.setenv("SHARDLAB_CPU_PROFILE", str(tmp_path / "missing.json"))
    assert predicted_step_s(s, res) is None  # no profile: unknown, not a guess
    (tmp_path / "cpu.json").write_text(json.dumps(
        {"name": "t", "kind": "cpu", "peak_flops": {"fp32": 5e10}, "hbm_bytes_per_s": 1e10, "intra_bytes_per_s": 1e9,
         "inter_bytes_per_s": 1e9, "cores": 2, "gpus_per_node": 4096, "tune": {}}))
    monkeypatch.setenv("SHARDLAB_CPU_PROFILE", str(tmp_path / "cpu.json"))
    assert predicted_step_s(s, res) > 0
    assert predicted_step_s(s, RunResult(status="ok", spec=s, env={"device": "NVIDIA H100 80GB HBM3"})) is None


def test_the_stack_column_reads_the_stored_spec(store_urls):
    """Issue 34: runs carry their stack in the spec JSON (no column of its own); the CSV's `stack` reads it, and a spec
    stored before stacks existed (no train.stack) exports as shardlab."""
    engine = store_urls.engine()
    from backend.spec.choices import Stack

    s = spec("titan").model_copy(deep=True)
    s.train.stack = Stack.TORCHTITAN
    eid = q.submit_experiment(engine, s)
    old = q.submit_experiment(engine, spec("old"))
    with engine.begin() as c:  # what a store written before issue 34 holds: a spec without train.stack
        row = c.execute(select(Experiment.spec_json).where(Experiment.id == old)).scalar_one()
        data = json.loads(row)
        data["train"].pop("stack", None)
        c.execute(update(Experiment).where(Experiment.id == old).values(spec_json=json.dumps(data)))
    rows = {r["name"]: r for r in _rows(export_csv(engine))}
    assert rows["titan"]["stack"] == "torchtitan" and rows["old"]["stack"] == "shardlab"
    assert eid != old


def test_capacity_factor_and_tokens_dropped_read_the_stored_spec_and_result(store_urls):
    """Issue 35: a MoE run with a capacity factor exports it and the slots it dropped (RunResult.tokens_dropped, kept in
    the stored result JSON: no column, no migration); a dropless run and a run stored before issue 35 leave them blank;
    the JSON export carries tokens_dropped inside "result"."""
    engine = store_urls.engine()
    moe = ExperimentSpec.model_validate({"name": "capped", "model": {"n_experts": 4, "capacity_factor": 1.25},
                                         "parallel": {"strategy": "ep", "world_size": 2}})
    eid = q.submit_experiment(engine, moe)
    res = fake_result(moe)
    res.tokens_dropped = 37
    q.store_result(engine, eid, res)
    plain = q.submit_experiment(engine, spec("dropless"))
    q.store_result(engine, plain, fake_result(spec("dropless")))
    rows = {r["name"]: r for r in _rows(export_csv(engine))}
    assert (float(rows["capped"]["capacity_factor"]), int(rows["capped"]["tokens_dropped"])) == (1.25, 37)
    assert rows["dropless"]["capacity_factor"] == rows["dropless"]["tokens_dropped"] == ""
    assert (rows["capped"]["moe_dispatcher"], rows["dropless"]["moe_dispatcher"]) == ("alltoall", "")
    _, table_rows = table(engine)
    got = {r["name"]: (r["capacity_factor"], r["tokens_dropped"]) for r in table_rows}
    assert got == {"capped": (1.25, 37), "dropless": (None, None)}
    data = {d["name"]: d for d in json.loads(export_json(engine))}
    assert data["capped"]["result"]["tokens_dropped"] == 37 and data["dropless"]["result"]["tokens_dropped"] is None


def test_the_moe_dispatcher_column_reads_the_stored_spec(store_urls):
    """An imported Megatron MoE run keeps its dispatcher in the spec JSON (no column, no migration): the CSV's
    moe_dispatcher reads it; a MoE spec stored before the field existed exports as alltoall; a dense run is blank."""
    engine = store_urls.engine()
    moe = {"n_experts": 4}
    flex = ExperimentSpec.for_prediction({"name": "flex", "model": moe | {"moe_dispatcher": "flex"},
                                          "parallel": {"strategy": "ep", "world_size": 2}})
    eid = q.submit_experiment(engine, flex)
    old = q.submit_experiment(engine, ExperimentSpec.model_validate({"name": "old", "model": moe,
                                                                      "parallel": {"strategy": "ep", "world_size": 2}}))
    with engine.begin() as c:  # a spec stored before model.moe_dispatcher existed
        data = json.loads(c.execute(select(Experiment.spec_json).where(Experiment.id == old)).scalar_one())
        data["model"].pop("moe_dispatcher", None)
        c.execute(update(Experiment).where(Experiment.id == old).values(spec_json=json.dumps(data)))
    q.submit_experiment(engine, spec("dense"))
    rows = {r["name"]: r for r in _rows(export_csv(engine))}
    assert (rows["flex"]["moe_dispatcher"], rows["old"]["moe_dispatcher"], rows["dense"]["moe_dispatcher"]) == \
        ("flex", "alltoall", "")
    assert eid != old


def test_a_result_json_that_does_not_parse_exports_with_its_reason(stored):
    """One row whose stored result JSON is corrupt (written by hand, a broken disk) must not break the export: the
    CSV (wide and long) and table() keep every row, the JSON read from that result blank and `result_error` saying
    why; the JSON export stays valid JSON, that row's "result" null with "result_error" and the text as stored."""
    engine, ids = stored
    bad, good = sorted(eid for eid, res in ids.items() if res is not None)[:2]
    broken = '{"status": "ok", broken'
    with engine.begin() as c:
        c.execute(update(Experiment).where(Experiment.id == bad).values(result_json=broken))
    for long in (False, True):
        rows = {int(r["id"]): r for r in _rows(export_csv(engine, long=long))}
        assert set(rows) == set(ids)
        assert rows[bad]["tokens_dropped"] == "" and "does not read" in rows[bad]["result_error"]
        assert rows[good]["result_error"] == "" and rows[bad]["step_s_median"] != ""  # its columns are kept
    _, table_rows = table(engine)
    assert [r["id"] for r in table_rows if r["result_error"]] == [bad]
    data = {d["id"]: d for d in json.loads(export_json(engine))}
    assert set(data) == set(ids) and data[bad]["result"] is None and data[bad]["result_json"] == broken
    assert "does not read" in data[bad]["result_error"] and q.get_experiment(engine, bad)["result"] is None
    assert data[good]["result"] == json.loads(ids[good].model_dump_json(by_alias=True))
    assert "result_error" not in data[good]


def test_json_export_keeps_an_interrupted_runs_log_tail_and_every_runs_kind(store_urls):
    """An interrupted run has no result: its log tail and first rank error live in their own columns, which the JSON
    export ("full spec and result of every run") left out, as it left out the kind (measured, imported, traced)."""
    engine = store_urls.engine()
    eid = q.submit_experiment(engine, spec("killed"))
    q.claim_next(engine, "w")
    left = q.LeftBehind(log_tail="[rank1] last line\n", error="rank 1: RuntimeError: boom", failing_rank=1,
                      traceback="Traceback: here")
    assert q.recover_stale(engine, -1.0, explain=lambda *_: left) == [eid]
    (d,) = json.loads(export_json(engine))
    assert d["status"] == "interrupted" and d["result"] is None and d["kind"] == "measured"
    assert (d["log_tail"], d["traceback"], d["failing_rank"]) == ("[rank1] last line\n", "Traceback: here", 1)
