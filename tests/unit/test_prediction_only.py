"""Layouts this engine can predict but not run (issue 20 item 5): `estimate` and New experiment predict every spec
`plan` outputs and say "prediction only" with the reason; `plan` marks each row; only run / submit refuse. The torch
limitation behind one of them is re-checked in the farm's ranks."""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from backend.cli import main
from backend.spec import ExperimentSpec, validate_spec
from backend.spec.checks import run_blockers
from tests.helpers.farm import TOL, parity_job, uses

APP = str(Path(__file__).resolve().parents[2] / "app.py")
ZBV_FSDP = {"model": {"vocab_size": 1000, "d_model": 128, "n_layers": 8, "n_heads": 8, "seq_len": 64},
            "train": {"global_batch": 16, "micro_batch": 1},
            "parallel": {"strategy": "fsdp", "world_size": 8, "tp": 2, "pp": 2, "pp_schedule": "zbv",
                         "virtual_stages": 2}}
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
            "--hardware", "h100-sxm", "--global-batch", "16", "--seq", "64", "--top", "40", "--json",
            "--include-predicted", "--precision", "fp16-mixed",  # fastest here: zero1 x pp, prediction only under fp16
            "--attention", "math"]  # the layouts this was written for (flash, the GPU default since issue 30, adds cp)
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
    # what Plan's "Open in New experiment" does
    at.session_state["clone_spec"] = ExperimentSpec.for_prediction(ZBV_FSDP)
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    assert not [e for e in at.error if "cannot run" in e.value]
    assert any(w.value.startswith(f"Prediction only: {WHY}") for w in at.warning)
    assert at.get("plotly_chart"), "the memory prediction is shown"
    assert {m.label for m in at.metric} >= {"parameters", "comm / step"}
    run = at.button(key="submit_one")
    assert run.disabled and run.help.startswith("prediction only: zbv with fsdp")


def test_plan_ranks_only_runnable_layouts_unless_asked(capsys):
    """Issue 26: the planner's top picks must train correctly here; --include-predicted brings the others back, marked.
    Fails before: plan ranked zbv x fsdp (and zero1 x ep) layouts among its picks with no way to leave them out."""
    argv = ["plan", "--vocab", "1000", "--hidden", "128", "--layers", "8", "--heads", "8", "--gpus", "8",
            "--hardware", "h100-sxm", "--global-batch", "16", "--seq", "64", "--top", "40", "--json",
            "--precision", "fp16-mixed"]
    assert main(argv) == 0
    default = json.loads(capsys.readouterr().out)
    assert default["configs"] and all(c["runnable"] for c in default["configs"])
    assert default["predicted_only_left_out"] > 0
    assert any("left out of the ranking" in n for n in default["notes"])
    assert main([*argv, "--include-predicted"]) == 0
    everything = json.loads(capsys.readouterr().out)
    assert any(not c["runnable"] and c["why_not"] for c in everything["configs"])
    assert everything["predicted_only_left_out"] == 0 and everything["feasible"] == default["feasible"]


def test_plan_leaves_out_what_the_model_cannot_run_and_says_which_rule():
    """A model whose every layout is prediction-only here (attention sinks under flash: torch SDPA has no sink logit)
    ranks nothing by default, and the note counts the fitting layouts each run rule leaves out. Fails before: the
    planner's array check knew only the layout rules, so it ranked such layouts and then marked each runnable=false."""
    from backend.analytic.steptime.hardware import get_hardware
    from backend.planner.search import plan
    from backend.spec import ModelSpec

    sinks = ModelSpec(vocab_size=1000, d_model=64, n_layers=4, n_heads=4, seq_len=32, attention_sinks=True,
                      attention="flash")
    res = plan(sinks, gpus=8, gpus_per_node=8, hw=get_hardware("h100-sxm"), global_batch=16, top=5)
    assert res.configs == [] and res.predicted_only_left_out == res.feasible > 0
    (note,) = [n for n in res.notes if "left out of the ranking" in n]
    assert f"attention sinks under flash attention: {res.feasible}" in note
    everything = plan(sinks, gpus=8, gpus_per_node=8, hw=get_hardware("h100-sxm"), global_batch=16, top=5,
                      include_predicted=True)
    assert everything.configs and not any(c["runnable"] for c in everything.configs)


@pytest.mark.heavy
def test_array_run_check_equals_run_blockers_on_every_layout():
    """planner.search.run_blocked (arrays) and backend.spec.checks.run_blockers (one spec) agree on every enumerated
    layout of a dense, a MoE, a windowed flash (cp searched: ring attention has no window) and a sinks model, in bf16,
    fp16 (blocks zero1 x tp/pp) and fp8 (blocks tp and ep). Both read the one rule table, backend/spec/run_rules.py."""
    import numpy as np

    from backend.planner.search import run_blocked
    from backend.planner.space import enumerate_layouts
    from backend.spec import ModelSpec

    dense = ModelSpec(vocab_size=1000, d_model=128, n_layers=8, n_heads=8, seq_len=64)
    moe = ModelSpec(vocab_size=1000, d_model=64, n_layers=4, n_heads=4, seq_len=32, n_experts=4, top_k=2)
    windowed = ModelSpec(vocab_size=1000, d_model=128, n_layers=8, n_heads=8, seq_len=64, window=16, attention="flash")
    sinks = ModelSpec(vocab_size=1000, d_model=64, n_layers=4, n_heads=4, seq_len=32, attention_sinks=True,
                      attention="flash")
    checked, mixed = 0, 0
    for model in (dense, moe, windowed, sinks):
        for precision in ("bf16-mixed", "fp16-mixed", "fp8"):
            layouts = enumerate_layouts(model, gpus=8, gpus_per_node=8, global_batch=16, precision=precision)
            blocked = run_blocked(layouts, model)
            mixed += model is windowed and bool(blocked.any()) and not bool(blocked.all())
            for i in np.random.default_rng(0).choice(len(layouts), size=min(400, len(layouts)), replace=False):
                spec = ExperimentSpec.for_prediction(layouts.take(int(i)).spec_dict(model))
                assert bool(blocked[i]) == bool(run_blockers(spec)), spec.name
                checked += 1
            assert model is not sinks or blocked.all()
    assert checked > 2000 and mixed


@pytest.mark.heavy
def test_estimate_accepts_200_random_plan_outputs(capsys):
    """Issue 26 'Done when': estimate accepts every spec plan prints. 200 configs from random plans (models, GPU
    counts, batches, precisions, prediction-only layouts included) go back through the estimate CLI."""
    rng = random.Random(26)
    configs: list[dict] = []
    while len(configs) < 200:
        heads = rng.choice([4, 8, 16])
        argv = ["plan", "--vocab", str(rng.choice([500, 1000, 32000])),
                "--hidden", str(heads * rng.choice([16, 32, 64])), "--layers", str(rng.choice([4, 6, 8, 12])),
                "--heads", str(heads),
                "--gpus", str(rng.choice([4, 8, 16, 32])), "--hardware", rng.choice(["h100-sxm", "a100-80gb-sxm"]),
                "--global-batch", str(rng.choice([16, 32, 64])), "--seq", str(rng.choice([64, 256, 1024])),
                "--precision", rng.choice(["bf16-mixed", "fp16-mixed", "fp32"]),
                "--top", "25", "--include-predicted", "--json"]
        if rng.random() < 0.3:
            argv += ["--experts", "4", "--top-k", "2"]
        assert main(argv) == 0, argv
        configs += json.loads(capsys.readouterr().out)["configs"]
    tmp = Path(tempfile.mkdtemp())
    for i, c in enumerate(configs[:200]):
        f = tmp / f"{i}.json"
        f.write_text(json.dumps(c["spec"]))
        assert main(["estimate", "--spec", str(f), "--json"]) == 0, c["spec"]["name"]
        out = json.loads(capsys.readouterr().out)
        assert out["runnable"] is c["runnable"] and out["per_rank"], c["spec"]["name"]


ZBV_PROBE_SPEC = {"name": "zbv_fsdp_probe",
                  "model": {"vocab_size": 64, "d_model": 32, "n_layers": 4, "n_heads": 4, "seq_len": 16},
                  "train": {"global_batch": 8, "micro_batch": 1, "steps": 2, "warmup_steps": 0},
                  "parallel": {"strategy": "fsdp", "world_size": 4, "pp": 2, "pp_schedule": "zbv", "virtual_stages": 2}}
DUALPIPEV_PROBE_SPEC = {**ZBV_PROBE_SPEC, "name": "dualpipev_fsdp_probe",
                        "parallel": {**ZBV_PROBE_SPEC["parallel"], "pp_schedule": "dualpipev"}}
SPLIT_BACKWARD_PROBES = {"zbv": parity_job(ExperimentSpec.for_prediction(ZBV_PROBE_SPEC)),
                         "dualpipev (issue 35)": parity_job(ExperimentSpec.for_prediction(DUALPIPEV_PROBE_SPEC),
                                                            timeout_s=400)}


@pytest.mark.slow
@uses(*SPLIT_BACKWARD_PROBES.values())
def test_torch_still_drops_fsdp2_grads_under_split_backward(farm):
    """The torch limitation behind the zbv/zero_bubble x FSDP2 rule (backend/spec/run_rules.py), re-checked on every
    torch upgrade: the engine runs the layout anyway here and its parameters drift from the single-process reference
    (torch 2.13: max |diff| 4.0e-3 after 2 steps; DualPipeV, the same split backward, likewise). When this test FAILS,
    torch has fixed it: remove that rule (one table, read by run_blockers and by the planner's run_blocked)."""
    for schedule, job in SPLIT_BACKWARD_PROBES.items():
        result = farm.result(job)
        assert result["param_max_abs_diff"] > 10 * TOL, (
            f"torch {__import__('torch').__version__} trains {schedule} x FSDP2 correctly now (max |diff| "
            f"{result['param_max_abs_diff']:.2g}): remove the split-backward x FSDP RunOnly")
