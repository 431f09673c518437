"""Issue 34: the New-experiment form and the Plan page have a Stack select with its settings under it (an expander);
a stack this engine does not run is prediction only with the reason, and the store keeps the stack in the spec."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from dashboard import spec_form as sf
from dashboard import stack_form

APP = str(Path(__file__).resolve().parents[2] / "app.py")


@pytest.fixture(autouse=True)
def ui_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    import streamlit as st

    st.cache_data.clear()


def test_form_values_round_trip_the_stack_settings():
    v = sf.default_form() | {"stack": "megatron", "attention_kernel": "flash3", "tp_overlap": "on", "pp_overlap": "off"}
    spec, problems = sf.form_to_spec(v, predict_only=True)
    assert spec is not None, problems
    assert (spec.train.stack, spec.train.attention_kernel, spec.train.tp_overlap, spec.train.pp_overlap) == (
        "megatron", "flash3", True, False)
    assert spec.train.elementwise is None  # left at the stack's default
    back = sf.spec_to_form(spec)
    assert {k: back[k] for k in ("stack", "attention_kernel", "tp_overlap", "elementwise")} == {
        "stack": "megatron", "attention_kernel": "flash3", "tp_overlap": "on", "elementwise": stack_form.DEFAULT}


def test_form_values_carry_megatrons_recompute_modules():
    v = sf.default_form() | {"stack": "megatron", "recompute": "selective", "recompute_modules": ["mlp"],
                             "tp": 2, "world_size": 2, "strategy": "tp", "sequence_parallel": True}
    spec, problems = sf.form_to_spec(v, predict_only=True)
    assert spec is not None, problems
    assert spec.train.recompute_modules == ["mlp"] and sf.spec_to_form(spec)["recompute_modules"] == ["mlp"]
    unset, _ = sf.form_to_spec(v | {"recompute_modules": []}, predict_only=True)
    assert unset.train.recompute_modules is None  # an empty multiselect: Megatron's default, core_attn


def test_new_experiment_recompute_modules_multiselect_reaches_the_spec():
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.selectbox(key="f_stack").set_value("megatron").run()
    at.multiselect(key="f_recompute_modules").set_value(["mlp"]).run()
    assert not at.exception
    assert any("recompute_modules" in e.value and "'selective'" in e.value for e in [*at.error, *at.warning])


def test_new_experiment_stack_select_makes_a_prediction_only_spec():
    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception and at.selectbox(key="f_stack").value == "shardlab"
    at.selectbox(key="f_stack").set_value("megatron").run()
    assert not at.exception
    assert any(w.value.startswith("Prediction only: ") and "stack megatron" in w.value for w in at.warning)
    at.selectbox(key="f_stack").set_value("shardlab").run()
    at.selectbox(key="f_elementwise").set_value("fused").run()
    assert any("elementwise=fused" in w.value for w in at.warning)
    at.selectbox(key="f_elementwise").set_value("compiled").run()  # the engine compiles the blocks (issue 34 part 4)
    assert not at.exception and not any(w.value.startswith("Prediction only: ") for w in at.warning)


@pytest.mark.heavy
def test_plan_page_plans_within_the_chosen_stack():
    at = AppTest.from_file(APP, default_timeout=120).run()
    at.switch_page("dashboard/pages/plan.py").run()
    at.selectbox(key="pl_preset").set_value(sf.preset_label("gpt2")).run()
    at.number_input(key="pl_seq").set_value(1024)
    at.number_input(key="pl_gpus").set_value(8)
    at.number_input(key="pl_batch").set_value(32)
    at.selectbox(key="pl_stack_stack").set_value("torchtitan").run()
    at.selectbox(key="pl_stack_elementwise").set_value("compiled").run()
    assert any("stack torchtitan (elementwise compiled)" in t.value for t in at.text)
    at.button(key="pl_go").click().run()
    assert not at.exception
    res = at.session_state["pl_result"]
    assert res.configs and all(c["spec"]["train"]["stack"] == "torchtitan" for c in res.configs)
