"""Layouts this engine can predict but not run (issue 20 item 5): `estimate` and New experiment predict every spec
`plan` outputs and say "prediction only" with the reason; `plan` marks each row; only run / submit refuse."""

from __future__ import annotations

import json
from pathlib import Path

from streamlit.testing.v1 import AppTest

from backend.cli import main
from backend.spec import ExperimentSpec, validate_spec
from backend.spec_checks import run_blockers

APP = str(Path(__file__).resolve().parents[1] / "app.py")
ZBV_FSDP = {"model": {"vocab_size": 1000, "d_model": 128, "n_layers": 8, "n_heads": 8, "seq_len": 64},
            "train": {"global_batch": 16, "micro_batch": 1},
            "parallel": {"strategy": "fsdp", "world_size": 8, "tp": 2, "pp": 2, "pp_schedule": "zbv", "virtual_stages": 2}}
FLAGS = ["--strategy", "fsdp", "--tp", "2", "--pp", "2", "--world", "8", "--layers", "8", "--hidden", "128", "--heads",
         "8", "--vocab", "1000", "--seq", "64", "--global-batch", "16", "--micro-batch", "1", "--schedule", "zbv",
         "--virtual-stages", "2"]
WHY = "zbv with fsdp on dp=2 is not supported: torch's split backward drops FSDP2 gradients of the last stage"


def test_run_blockers_split_predictable_from_runnable():
    spec, problems = validate_spec(ZBV_FSDP, predict_only=True)
    assert not problems
    assert len(run_blockers(spec)) == 1 and run_blockers(spec)[0].startswith(WHY)
    assert validate_spec(ZBV_FSDP)[0] is None  # a run still refuses it
    ddp, _ = validate_spec({**ZBV_FSDP, "parallel": {**ZBV_FSDP["parallel"], "strategy": "ddp"}})
    assert run_blockers(ddp) == []
    _, problems = validate_spec({**ZBV_FSDP, "parallel": {**ZBV_FSDP["parallel"], "tp": 3}}, predict_only=True)
    assert "world_size(8) is not divisible by tp(3) * pp(2) = 6" in problems  # real errors stay errors


def test_estimate_predicts_it_and_run_submit_refuse(capsys, tmp_path):
    assert main(["estimate", *FLAGS, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["runnable"] is False and d["why_not"].startswith(WHY)
    assert len(d["per_rank"]) == 8 and all(r["total_bytes"] > 0 for r in d["per_rank"])
    assert main(["estimate", *FLAGS]) == 0
    assert "prediction only (run/submit refuse it): zbv with fsdp" in capsys.readouterr().out
    assert main(["submit", "--db", f"sqlite:///{tmp_path / 's.db'}", *FLAGS]) == 2
    assert WHY in capsys.readouterr().err
    assert main(["run", *FLAGS, "--workdir", str(tmp_path / "r")]) == 2
    assert not (tmp_path / "r").exists()


def test_plan_json_marks_every_config(capsys):
    argv = ["plan", "--vocab", "1000", "--hidden", "128", "--layers", "8", "--heads", "8", "--gpus", "8",
            "--hardware", "h100-sxm", "--global-batch", "16", "--seq", "64", "--top", "40", "--json"]
    assert main(argv) == 0
    configs = json.loads(capsys.readouterr().out)["configs"]
    for c in configs:
        blockers = run_blockers(ExperimentSpec.for_prediction(c["spec"]))
        assert c["runnable"] is (not blockers) and c["why_not"] == ("; ".join(blockers) or None)
    assert any(not c["runnable"] for c in configs) and any(c["runnable"] for c in configs)


def test_form_shows_the_prediction_of_a_prediction_only_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.session_state["clone_spec"] = ExperimentSpec.for_prediction(ZBV_FSDP)  # what Plan's "Open in New experiment" does
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    assert not [e for e in at.error if "cannot run" in e.value]
    assert any(w.value.startswith(f"Prediction only: {WHY}") for w in at.warning)
    assert at.get("plotly_chart"), "the memory prediction is shown"
    assert {m.label for m in at.metric} >= {"parameters", "comm / step"}
    run = at.button(key="submit_one")
    assert run.disabled and run.help.startswith("prediction only: zbv with fsdp")
