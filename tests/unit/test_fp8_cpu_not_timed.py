"""fp8 on CPU ranks is not timed (issue 30 item 6): the 'cpu' profile times GEMMs at fp32's rate and has no terms
for torchao's float8 casts and scaling, so an fp8 CPU run's prediction was 0.016 s against 2.98 s measured. Every
place that shows a CPU step-time prediction says so instead of showing a number; GPU profiles still time fp8."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.analytic.steptime.untimed import NotTimed
from backend.result import RunResult
from tests.helpers.store_helpers import fake_result, spec

CPU_PROFILE = {"name": "t", "kind": "cpu", "peak_flops": {"fp32": 5e10, "bf16": 5e10, "fp16": 5e10},
               "hbm_bytes_per_s": 1e10, "intra_bytes_per_s": 1e9, "inter_bytes_per_s": 1e9, "cores": 2,
               "gpus_per_node": 4096, "tune": {}}


@pytest.fixture(autouse=True)
def cpu_profile(tmp_path, monkeypatch):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(CPU_PROFILE))
    monkeypatch.setenv("SHARDLAB_CPU_PROFILE", str(path))
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")


def _fp8(**train):
    from backend.spec import ExperimentSpec

    s = spec("fp8 run", strategy="fsdp")
    data = s.model_dump(mode="json")
    data["train"].update(precision="fp8", **train)
    return ExperimentSpec.model_validate(data)


def test_the_model_refuses_to_time_fp8_on_cpu_ranks_and_times_it_on_gpus():
    with pytest.raises(NotTimed, match="fp8 on CPU ranks is not timed"):
        step_time(_fp8(), get_hardware("cpu"))
    assert step_time(_fp8(), get_hardware("h100-sxm")).summary["step_s"] > 0
    assert step_time(spec("fp32"), get_hardware("cpu")).summary["step_s"] > 0


def test_a_run_stores_no_number_and_a_note_saying_why():
    from backend.launch.launcher import predicted_step_s

    s = _fp8()
    res = RunResult(status="ok", spec=s, env={"device": "cpu"})
    assert predicted_step_s(s, res) is None  # before: 0.016 s for a run that took 2.98 s
    assert any("fp8 on CPU ranks is not timed" in n for n in res.notes)
    plain = RunResult(status="ok", spec=spec("fp32"), env={"device": "cpu"})
    assert predicted_step_s(plain.spec, plain) > 0 and plain.notes == []


def test_estimate_on_the_cpu_profile_says_not_timed(capsys):
    from backend.cli import main

    flags = ["estimate", "--layers", "2", "--hidden", "64", "--heads", "4", "--world", "2", "--strategy", "fsdp",
             "--precision", "fp8", "--hardware", "cpu"]
    assert main([*flags, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["step_time"] is None and "fp8 on CPU ranks is not timed" in data["step_time_detail"]["not_timed"]
    assert main(flags) == 0
    assert "step time on cpu: not timed: fp8 on CPU ranks" in capsys.readouterr().out


def test_run_detail_and_new_experiment_show_the_reason_not_a_number(monkeypatch):
    import os

    from streamlit.testing.v1 import AppTest

    from db import queries as q
    from db.session import open_db

    engine = open_db(os.environ["SHARDLAB_DB_URL"])
    s = _fp8()
    eid = q.submit_experiment(engine, s)
    q.claim_next(engine, "w")
    res = fake_result(s)
    res.env["device"] = "cpu"
    q.store_result(engine, eid, res)
    app = str(Path(__file__).resolve().parents[2] / "app.py")
    at = AppTest.from_file(app, default_timeout=60).run()
    at.query_params["run"] = str(eid)
    at.switch_page("dashboard/pages/run_detail.py").run()
    assert not at.exception, [e.message for e in at.exception]
    assert any("No step-time comparison: fp8 on CPU ranks is not timed" in t.value for t in at.text)
    assert not [m for m in at.metric if m.label == "step time predicted"]


def test_calibration_leaves_fp8_cpu_runs_out():
    import os

    from backend.calibration.records import samples
    from db import queries as q
    from db.session import open_db

    engine = open_db(os.environ["SHARDLAB_DB_URL"])
    ids = []
    for s in (_fp8(), spec("fp32")):
        eid = q.submit_experiment(engine, s)
        q.claim_next(engine, "w")
        res = fake_result(s)
        res.env.update(device="cpu", device_type="cpu")
        q.store_result(engine, eid, res)
        ids.append(eid)
    got, problems = samples(engine, ids=ids, hardware="cpu")
    assert [x.run_id for x in got] == [ids[1]]
    assert any(f"run {ids[0]} left out: fp8 on CPU ranks is not timed" in p for p in problems)


@pytest.mark.heavy
def test_plan_with_fp8_on_the_cpu_profile_says_why_it_ranks_nothing(capsys):
    """Before: `plan --precision fp8 --hardware cpu` ended in a NotTimed traceback inside the planner's re-timing."""
    from backend.cli import main

    flags = ["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "256", "--seq", "64", "--gpus", "2",
             "--global-batch", "4", "--hardware", "cpu", "--memory-gb", "8"]
    assert main([*flags, "--precision", "fp8"]) == 2
    err = capsys.readouterr().err
    assert "plan cannot rank the" in err and "fp8 on CPU ranks is not timed" in err and "Traceback" not in err
    assert main([*flags, "--precision", "bf16-mixed", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["configs"]
