"""What a step-time prediction assumes in place of what the spec asks for is said with the number (`estimate`'s table
and JSON, New experiment), and fp8 on a GPU without fp8 tensor cores (Ampere) is not timed at all: before, `estimate
--precision fp8 --hardware a100-80gb-sxm` printed a step at 68% MFU with no word that such a run cannot start, and
`--attention-kernel flash3` on an A100 printed FlashAttention-2's time with the note only in the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.analytic.steptime.untimed import NotTimed
from backend.cli import main
from backend.spec import ExperimentSpec

A100, H100 = "a100-80gb-sxm", "h100-sxm"
FLAGS = ["estimate", "--layers", "2", "--hidden", "256", "--heads", "4", "--vocab", "1024", "--seq", "512",
         "--world", "8", "--strategy", "zero3", "--global-batch", "16", "--micro-batch", "1"]


def _spec(precision: str = "bf16-mixed", **train) -> ExperimentSpec:
    return ExperimentSpec.for_prediction({
        "model": {"vocab_size": 1024, "d_model": 256, "n_layers": 2, "n_heads": 4, "seq_len": 512},
        "train": {"global_batch": 16, "micro_batch": 1, "precision": precision, **train},
        "parallel": {"strategy": "zero3", "world_size": 8}})


def test_fp8_is_not_timed_on_ampere_and_is_on_gpus_with_fp8_cores():
    with pytest.raises(NotTimed, match=f"fp8 does not run on {A100}: Ampere .* compute capability 8.9"):
        step_time(_spec("fp8"), get_hardware(A100))
    for hardware in (H100, "h200", "b200", "mi300x"):
        assert step_time(_spec("fp8"), get_hardware(hardware)).summary["step_s"] > 0, hardware
    assert step_time(_spec(), get_hardware(A100)).summary["step_s"] > 0


def test_estimate_says_fp8_does_not_run_on_an_a100_and_plan_ranks_nothing(capsys):
    assert main([*FLAGS, "--precision", "fp8", "--hardware", A100, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["step_time"] is None and f"fp8 does not run on {A100}" in data["step_time_detail"]["not_timed"]
    assert data["fit"]["hardware"] == A100, "the memory check still answers"
    assert main([*FLAGS, "--precision", "fp8", "--hardware", A100]) == 0
    assert f"step time on {A100}: not timed: fp8 does not run on {A100}" in capsys.readouterr().out
    plan = ["plan", "--layers", "2", "--hidden", "256", "--heads", "4", "--vocab", "1024", "--seq", "512", "--gpus",
            "8", "--global-batch", "16", "--hardware", A100, "--precision", "fp8"]
    assert main(plan) == 2
    err = capsys.readouterr().err
    assert "plan cannot rank the" in err and f"fp8 does not run on {A100}" in err and "Traceback" not in err


def test_estimate_prints_what_the_step_time_assumes(capsys):
    flash3 = [*FLAGS, "--precision", "bf16-mixed", "--attention-kernel", "flash3"]
    assert main([*flash3, "--hardware", A100, "--json"]) == 0
    detail = json.loads(capsys.readouterr().out)["step_time_detail"]
    caveat = f"FlashAttention-3 runs on Hopper; {A100} (sm80) times it as FlashAttention-2"
    assert detail["caveats"] == [caveat] and caveat in detail["notes"]
    assert not any(n.startswith(("attention=", "stack=")) for n in detail["caveats"]), "the header notes stay apart"
    assert main([*flash3, "--hardware", A100]) == 0
    assert f"step-time note: {caveat}" in capsys.readouterr().out.splitlines()
    assert main([*flash3, "--hardware", H100, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_detail"]["caveats"] == []
    assert main([*flash3, "--hardware", H100]) == 0
    assert "step-time note:" not in capsys.readouterr().out


def test_new_experiment_shows_the_caveats_under_the_step_time(tmp_path, monkeypatch):
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    st.cache_data.clear()
    app = str(Path(__file__).resolve().parents[2] / "app.py")
    at = AppTest.from_file(app, default_timeout=60).run()
    at.session_state["clone_spec"] = _spec(attention_kernel="flash3")
    at.session_state["clone_hardware"] = (A100, 8)
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    assert any(m.label == "step time (predicted)" for m in at.metric)
    captions = [c.value for c in at.caption]
    assert f"Step time assumes: FlashAttention-3 runs on Hopper; {A100} (sm80) times it as FlashAttention-2" in captions


def test_an_imported_fp8_run_on_an_ampere_profile_says_why_it_has_no_prediction():
    from types import SimpleNamespace

    from backend.result import ImportFacts
    from dashboard.import_view import step_comparison

    run = SimpleNamespace(spec=_spec("fp8"), imported=ImportFacts(framework="torchtitan", hardware=A100),
                          step_s_median=1.0)
    comparison, why = step_comparison(run)
    assert comparison is None and f"fp8 does not run on {A100}" in why
    run.imported.hardware = H100
    comparison, why = step_comparison(run)
    assert why is None and comparison["predicted_s"] > 0


def test_plan_says_what_its_step_times_assume_and_the_plan_page_warns(capsys):
    from dashboard import plan_view as pv

    flags = ["plan", "--layers", "2", "--hidden", "256", "--heads", "4", "--vocab", "1024", "--seq", "512", "--gpus",
             "8", "--global-batch", "16", "--precision", "bf16-mixed", "--attention-kernel", "flash3", "--top", "2"]
    caveat = f"step time assumes: FlashAttention-3 runs on Hopper; {A100} (sm80) times it as FlashAttention-2"
    assert main([*flags, "--hardware", A100]) == 0
    assert f"note: {caveat}" in capsys.readouterr().out.splitlines()
    assert main([*flags, "--hardware", H100]) == 0
    assert "step time assumes" not in capsys.readouterr().out
    model = pv.ModelSpec(vocab_size=1024, d_model=256, n_layers=2, n_heads=4, seq_len=512)
    held = pv.HeldTraining(stack_settings=(("attention_kernel", "flash3"),))
    res = pv.run_plan(model, gpus=8, gpus_per_node=8, hardware=A100, global_batch=16, memory_gb=None, top=2,
                      held=held)
    assert caveat[0].upper() + caveat[1:] in pv.warning_notes(res)
    assert not any(n.startswith("step time assumes") for n in pv.other_notes(res))
