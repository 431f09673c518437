"""Context parallelism on every surface besides run / trace / estimate: the New-experiment form (round trip, the page
with cp set), the Plan table and its scaled-down verify run, the runs table, sweeps, the CSV export, plan -> estimate,
and the estimate and plan JSON of the CLI (a bad cp degree refused with its arithmetic)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from backend.spec import ExperimentSpec
from backend.sweep import expand_grid
from dashboard import plan_view, runs_view
from dashboard import spec_form as sf
from db import queries as q
from db.export import export_csv
from tests.helpers.launch import cli
from tests.helpers.store_helpers import TINY, fake_result

ROOT = Path(__file__).resolve().parents[2]
FLASH_TINY = {**TINY, "model": {**TINY["model"], "attention": "flash"}}


def test_form_round_trips_cp_and_describes_it():
    v = sf.default_form() | {"attention": "flash", "world_size": 4, "cp": 2, "cp_rotate": "alltoall",
                             "cp_load_balance": False}
    spec, problems = sf.form_to_spec(v)
    assert problems == [] and (spec.parallel.cp, str(spec.parallel.cp_rotate), spec.parallel.cp_load_balance) == (
        2, "alltoall", False) and spec.parallel.dp == 2
    back, problems = sf.form_to_spec(sf.spec_to_form(spec))
    assert problems == [] and back.parallel == spec.parallel
    assert "cp2 alltoall contiguous" in sf.describe(spec)
    _, problems = sf.form_to_spec(sf.default_form() | {"cp": 2})
    assert any("needs attention=flash" in p for p in problems)


def test_new_experiment_page_takes_cp(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
    at.selectbox(key="f_attention").set_value("flash")
    at.number_input(key="f_cp").set_value(2).run()
    assert not at.exception, [e.message for e in at.exception]
    errors = " ".join(e.value for e in at.error)
    assert "cp" not in errors, errors
    at.number_input(key="f_world_size").set_value(3).run()
    assert "is not divisible by tp(1) * pp(1) * cp(2) = 2" in " ".join(e.value for e in at.error)


def test_plan_table_and_verify_run_carry_cp():
    spec = ExperimentSpec.for_prediction({**FLASH_TINY, "model": {**FLASH_TINY["model"], "seq_len": 64},
                                          "parallel": {"strategy": "fsdp", "world_size": 16, "cp": 8, "tp": 2}})
    config = {"spec": spec.model_dump(mode="json") | {"name": "plan dp1·tp2·pp1·cp8 zero3"}, "strategy": "zero3",
              "mem_bytes_max": 1, "step_time": dict.fromkeys(("step_s", "low_s", "high_s", "mfu", "tokens_per_s",
                                                             "tflops_per_gpu"), 1.0)}
    frame = plan_view.results_frame(type("P", (), {"configs": [config]})())
    assert frame.loc[0, "cp"] == 8
    small, problems = plan_view.scaled_down_spec(config)
    assert problems == [] and small.parallel.cp == 2 and small.parallel.world_size <= 4


def test_runs_table_degrees_show_cp():
    assert runs_view.degrees_text({"dp": 2, "tp": 2, "pp": 1, "ep": 1, "cp": 4}) == "dp2×tp2×cp4"


def test_sweep_over_cp():
    base = {**FLASH_TINY, "train": {**FLASH_TINY["train"], "global_batch": 8}, "parallel": {"world_size": 4}}
    specs, invalid = expand_grid(ExperimentSpec.model_validate(base),
                                 {"cp": [1, 2, 4], "cp_rotate": ["allgather", "alltoall"]})
    assert [(s.parallel.cp, s.parallel.dp) for s in specs[::2]] == [(1, 4), (2, 2), (4, 1)] and invalid == []


def test_csv_has_the_cp_columns_blank_without_cp(store_urls):
    engine = store_urls.engine()
    plain = ExperimentSpec.model_validate({**FLASH_TINY, "name": "plain"})
    ring = ExperimentSpec.model_validate({**FLASH_TINY, "name": "ring", "parallel": {"world_size": 2, "cp": 2,
                                                                                      "cp_rotate": "alltoall"}})
    for s in (plain, ring):
        q.store_result(engine, q.submit_experiment(engine, s), fake_result(s))
    rows = {r["name"]: r for r in csv.DictReader(io.StringIO(export_csv(engine)))}
    assert (rows["ring"]["cp"], rows["ring"]["cp_rotate"], rows["ring"]["cp_load_balance"]) == ("2", "alltoall", "True")
    assert (rows["plain"]["cp"], rows["plain"]["cp_rotate"], rows["plain"]["cp_load_balance"]) == ("1", "", "")
    assert [r["cp"] for r in q.list_experiments(engine)] in ([2, 1], [1, 2])



@pytest.mark.heavy
def test_estimate_accepts_200_plan_outputs_with_cp(capsys):
    """Issue 26 'estimate accepts every spec that plan prints': 200 layouts of a 32k-context plan (nearly all with
    cp > 1) each validate for prediction and estimate."""
    from backend.analytic.estimate import estimate
    from backend.cli import main

    argv = ["plan", "--preset", "llama-3-8b", "--gpus", "64", "--global-batch", "32", "--seq", "32768",
            "--hardware", "h100-sxm", "--attention", "flash", "--top", "200", "--json"]
    assert main(argv) == 0
    configs = json.loads(capsys.readouterr().out)["configs"]
    assert len(configs) == 200 and sum(c["spec"]["parallel"]["cp"] > 1 for c in configs) >= 100
    for c in configs:
        spec = ExperimentSpec.for_prediction(c["spec"])
        est = estimate(spec, device="cuda")
        assert est.per_rank and all(r.total_bytes > 0 for r in est.per_rank)


def test_cli_estimate_and_plan_json_carry_cp():
    est = cli("estimate", "--world", "4", "--cp", "2", "--cp-rotate", "alltoall", "--no-cp-load-balance",
              "--attention", "flash", "--seq", "32", "--json")
    assert est.code == 0, est.err
    out = json.loads(est.out)
    assert out["per_rank"][1]["coords"] == {"pp": 0, "dp": 0, "cp": 1, "tp": 0, "ep": 0}
    assert "all_to_all" in out["comm_bytes_per_step"]
    bad = cli("estimate", "--world", "4", "--cp", "3", "--attention", "flash", "--json")
    assert bad.code == 2 and "is not divisible by tp(1) * pp(1) * cp(3) = 3" in bad.err + bad.out
    plan = cli("plan", "--preset", "llama-3-8b", "--gpus", "64", "--global-batch", "16", "--seq", "65536",
               "--hardware", "h100-sxm", "--attention", "flash", "--top", "3", "--json")
    assert plan.code == 0, plan.err
    configs = json.loads(plan.out)["configs"]
    assert configs and all("cp" in c["spec"]["parallel"] for c in configs)
    assert any(c["spec"]["parallel"]["cp"] > 1 for c in configs)  # 64k context: the planner picks cp
