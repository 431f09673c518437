"""`python -m backend submit|list|show|cancel|requeue|delete|tag|export` against a real SQLite file (and PostgreSQL),
the database given by --db or by SHARDLAB_DB_URL."""

from __future__ import annotations

import csv
import io
import json

import pytest

from backend.cli import main
from db import queries as q
from db.session import open_db
from tests.helpers.launch import cli
from tests.helpers.store_helpers import TINY, fake_result

FLAGS = ["--world", "2", "--hidden", "32", "--layers", "2", "--heads", "2", "--seq", "16", "--vocab", "64",
         "--global-batch", "4", "--micro-batch", "2", "--steps", "2"]
EVIL = "Robert'); DROP TABLE experiments;--"


@pytest.fixture
def db(store_urls):
    return store_urls.url("cli.db")


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_submit_prints_the_id_and_rejects_bad_specs_with_the_arithmetic(capsys, db, tmp_path):
    code, out, _ = run(capsys, "submit", "--db", db, *FLAGS, "--name", "=cmd()", "--tag", EVIL, "--tag", "ünï©ødé 🚀")
    assert code == 0
    eid = int(out)
    engine = open_db(db)
    row = q.get_experiment(engine, eid)
    assert row["name"] == "=cmd()" and sorted(row["tags"]) == sorted([EVIL, "ünï©ødé 🚀"]) and row["d_model"] == 32
    code, out, err = run(capsys, "submit", "--db", db, *FLAGS, "--world", "3")
    assert code == 2 and out == "" and "global batch 4 is not divisible by micro-batch 2 * dp 3 = 6" in err
    spec_file = tmp_path / "s.json"
    spec_file.write_text(json.dumps(TINY))
    code, out, _ = run(capsys, "submit", "--db", db, "--spec", str(spec_file), "--strategy", "zero2")
    assert code == 0 and q.get_experiment(engine, int(out))["strategy"] == "zero2"
    assert q.count_experiments(engine) == 2


def test_sweep_queues_valid_points_and_reports_invalid_ones(capsys, db, tmp_path):
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"strategy": ["ddp", "tp"], "world": [1, 2]}))
    code, out, err = run(capsys, "submit", "--db", db, *FLAGS, "--sweep", str(grid), "--tag", "g")
    assert code == 0 and len(out.split()) == 3
    assert 'invalid point {"strategy": "tp", "world": 1}' in err and "strategy tp needs tp >= 2" in err
    engine = open_db(db)
    rows = q.list_experiments(engine, tag="g")
    assert sorted(r["id"] for r in rows) == sorted(map(int, out.split())) and len({r["sweep_id"] for r in rows}) == 1
    code, out, err = run(capsys, "submit", "--db", db, *FLAGS, "--sweep", str(grid), "--strict")
    assert code == 2 and out == "" and "nothing queued" in err and q.count_experiments(engine) == 3
    grid.write_text(json.dumps({"parallel.bogus": [1]}))
    code, _, err = run(capsys, "submit", "--db", db, *FLAGS, "--sweep", str(grid))
    assert code == 2 and "unknown sweep key 'parallel.bogus'" in err


def test_list_show_cancel_requeue_tag_delete(capsys, db, tmp_path):
    ids = [int(run(capsys, "submit", "--db", db, *FLAGS, "--name", n)[1]) for n in ("one", "two")]
    engine = open_db(db)
    q.claim_next(engine, "w")
    q.store_result(engine, ids[0], fake_result(q.get_experiment(engine, ids[0])["spec"], "timeout"))
    code, out, _ = run(capsys, "list", "--db", db)
    assert code == 0 and "timeout" in out and "queued" in out and "two" in out
    code, out, _ = run(capsys, "list", "--db", db, "--status", "timeout", "--json")
    assert [r["id"] for r in json.loads(out)] == [ids[0]]
    code, out, _ = run(capsys, "show", str(ids[0]), "--db", db, "--json")
    shown = json.loads(out)
    assert shown["result"]["status"] == "timeout" and shown["spec"]["model"]["d_model"] == 32
    assert shown["log_tail"] == "line 1\nline 2"
    code, out, _ = run(capsys, "show", str(ids[0]), "--db", db)
    assert code == 0 and "log tail:" in out and "rank 1 raised" in out
    assert run(capsys, "show", "999", "--db", db)[0] == 1
    assert run(capsys, "cancel", str(ids[1]), "--db", db)[1].strip() == "cancelled"
    code, out, _ = run(capsys, "requeue", str(ids[0]), "--db", db)
    new = int(out)
    assert q.get_experiment(engine, new)["requeue_of"] == ids[0]
    code, _, err = run(capsys, "requeue", str(new), "--db", db)
    assert code == 1 and "is queued" in err
    code, out, _ = run(capsys, "tag", str(new), EVIL, "x", "--db", db)
    assert json.loads(out) == [EVIL, "x"] and sorted(q.get_experiment(engine, new)["tags"]) == sorted([EVIL, "x"])
    assert run(capsys, "delete", str(ids[1]), "--db", db)[0] == 0
    assert q.get_experiment(engine, ids[1]) is None and q.count_experiments(engine) == 2


def test_export_to_file_with_filters(capsys, db, tmp_path):
    for name in ("=1+2", "plain"):
        run(capsys, "submit", "--db", db, *FLAGS, "--name", name, "--tag", name)
    out_file = tmp_path / "x.csv"
    assert run(capsys, "export", "--db", db, "--format", "csv", "-o", str(out_file))[0] == 0
    rows = list(csv.DictReader(io.StringIO(out_file.read_text(encoding="utf-8"), newline="")))
    assert [r["name"] for r in rows] == ["'=1+2", "plain"]
    code, out, _ = run(capsys, "export", "--db", db, "--format", "json", "--tag", "=1+2")
    assert [d["name"] for d in json.loads(out)] == ["=1+2"]


def test_db_url_comes_from_the_environment(store_urls, tmp_path):
    url = store_urls.url("env.db")
    sub = cli("submit", *FLAGS, env={"SHARDLAB_DB_URL": url})
    assert sub.code == 0, sub.err
    listed = cli("list", "--json", env={"SHARDLAB_DB_URL": url})
    assert [r["id"] for r in json.loads(listed.out)] == [int(sub.out)]
    assert store_urls.backend != "sqlite" or (tmp_path / "env.db").exists()


@pytest.mark.parametrize("imported", [False, True], ids=["measured", "imported"])
def test_show_and_long_export_agree_on_an_even_count_median(capsys, db, imported):
    """Four timed steps: the median is the mean of the middle two (0.3125), where sorted(s)[len(s) // 2] gave 0.375."""
    from backend.result import ImportFacts

    eid = int(run(capsys, "submit", "--db", db, *FLAGS)[1])
    engine = open_db(db)
    q.claim_next(engine, "w")
    result = fake_result(q.get_experiment(engine, eid)["spec"])
    for r in result.per_rank:
        r.step_s = [0.5, 0.125, 0.375, 0.25]
    if imported:
        result.imported = ImportFacts(framework="torchtitan")
    q.store_result(engine, eid, result)
    shown = run(capsys, "show", str(eid), "--db", db)[1].split("spec:")[0]
    medians_shown = [line.split()[-1] for line in shown.splitlines() if line.strip()[:1] in ("0", "1")]
    code, out, _ = run(capsys, "export", "--db", db, "--long")
    medians_exported = [r["rank_step_s_median"] for r in csv.DictReader(io.StringIO(out))]
    assert code == 0 and medians_shown == medians_exported == ["0.3125", "0.3125"]


def test_show_prints_a_dash_for_the_peak_a_timed_out_run_never_measured(capsys, db):
    """As the launcher stores a timed-out run: the prediction per rank, its measured breakdown the zero defaults. The
    rank rows hold NULL; show printed measured_peak 0 (and the run report 0.000 MiB, -100.0%)."""
    from backend.cli.run_summary import summary
    from backend.launch.launcher import failed_result
    from backend.launch.outcome import Failure
    from backend.result import Status

    eid = int(run(capsys, "submit", "--db", db, *FLAGS)[1])
    engine = open_db(db)
    q.claim_next(engine, "w")
    result = failed_result(q.get_experiment(engine, eid)["spec"], Failure(Status.TIMEOUT, "timed out after 1 s"), {})
    q.store_result(engine, eid, result)
    shown = run(capsys, "show", str(eid), "--db", db)[1].split("spec:")[0]
    table = shown.split("rank  measured_peak  predicted_peak  step_s_median\n")[1].splitlines()[:2]
    assert [line.split()[:2] for line in table] == [["0", "-"], ["1", "-"]]
    assert all(int(line.split()[2]) > 0 for line in table)
    memory = [line.split() for line in summary(result).splitlines() if line.split()[1:2] == ["peak"]]
    assert [(m[2], m[4]) for m in memory] == [("-", "-"), ("-", "-")]


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_export_to_dash_is_stdout_not_a_file_named_dash(capsys, db, tmp_path, monkeypatch, fmt):
    run(capsys, "submit", "--db", db, *FLAGS, "--name", "dash")
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "export", "--db", db, "--format", fmt, "-o", "-")
    assert code == 0 and "dash" in out and not (tmp_path / "-").exists()
    assert out == run(capsys, "export", "--db", db, "--format", fmt)[1]
    assert run(capsys, "export", "--db", db, "--format", fmt, "-o", "./-") == (0, "", "")
    assert "dash" in (tmp_path / "-").read_text(encoding="utf-8")  # ./- is how a file named "-" is asked for
    code, out, err = run(capsys, "export", "--db", db, "--format", fmt, "-o", str(tmp_path / "no" / "x"))
    assert code == 2 and out == "" and f"cannot write -o '{tmp_path / 'no' / 'x'}': No such file" in err


@pytest.mark.parametrize("status", ["ok", "timeout", "cancelled"])
def test_cancel_of_a_finished_run_says_nothing_was_cancelled(capsys, db, status):
    """It printed the run's status ("ok") with exit 0, which read as "cancelled ok"; now a refusal like requeue's of a
    queued run: exit 1, the status named, the row unchanged."""
    eid = int(run(capsys, "submit", "--db", db, *FLAGS)[1])
    engine = open_db(db)
    q.claim_next(engine, "w")
    q.store_result(engine, eid, fake_result(q.get_experiment(engine, eid)["spec"], status))
    code, out, err = run(capsys, "cancel", str(eid), "--db", db)
    assert code == 1 and out == ""
    assert f"experiment {eid} already finished (status {status}): nothing was cancelled" in err
    assert q.get_status(engine, eid) == status and not q.get_experiment(engine, eid)["cancel_requested"]


HUGE = "99999999999999999999"


@pytest.mark.parametrize("argv", [["show", HUGE], ["cancel", HUGE], ["delete", "-1"], ["requeue", HUGE], ["tag", HUGE],
                                  ["list", "--limit", "-5"]])
def test_an_id_or_limit_the_store_cannot_hold_is_a_usage_error(capsys, db, argv):
    """Before, an id beyond the store's integers overflowed the SQLite driver (a traceback), and PostgreSQL refused a
    negative LIMIT."""
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--db", db])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and ("is not a run id" in err or "--limit -5: give 0" in err)
