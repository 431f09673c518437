"""A spec loaded into the New-experiment form (Edit as new, an import, Plan) keeps the fields no widget shows: fp8's
all-gather switch, op-SAC's op list, the norm epsilon, the process-group backend and device. Before, the form
rebuilt them at their defaults, so the run it submitted was not the spec it loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from backend.spec import validate_spec
from dashboard import spec_form as sf

APP = str(Path(__file__).resolve().parents[2] / "app.py")
TINY = {"model": {"vocab_size": 128, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
        "train": {"global_batch": 4, "micro_batch": 2, "steps": 2, "warmup_steps": 1}}


def _spec(model=None, train=None, runtime=None, strategy="fsdp"):
    spec, problems = validate_spec({"model": TINY["model"] | (model or {}), "train": TINY["train"] | (train or {}),
                                    "parallel": {"strategy": strategy, "world_size": 2}, "runtime": runtime or {}},
                                   predict_only=True)
    assert not problems, problems
    return spec


@pytest.mark.parametrize("section, field, value, extra", [
    ("train", "fp8_all_gather", False, {"precision": "fp8"}),
    ("train", "recompute_ops", ["aten.mm.default"], {"recompute": "op"}),
    ("model", "norm_eps", 1e-6, {}),
    ("runtime", "backend", "gloo", {}),
    ("runtime", "device", "cuda", {}),  # a Plan layout's: its prediction counts the CUDA context and allocator slack
])
def test_a_loaded_spec_keeps_the_fields_no_widget_shows(section, field, value, extra):
    parts = {section: {field: value}}
    if extra:
        parts["train"] = parts.get("train", {}) | extra
    spec = _spec(**parts)
    back, problems = sf.form_to_spec(sf.spec_to_form(spec), predict_only=True)
    assert not problems, problems
    assert back.model_dump(mode="json") == spec.model_dump(mode="json")


def test_op_list_is_dropped_when_the_user_picks_another_recompute_policy():
    v = sf.spec_to_form(_spec(train={"recompute": "op", "recompute_ops": ["aten.mm.default"]}))
    spec, problems = sf.form_to_spec(v | {"recompute": "full"}, predict_only=True)
    assert not problems, problems
    assert spec.train.recompute_ops is None


def test_run_it_here_runs_on_this_hosts_ranks_not_the_loaded_device():
    v = sf.spec_to_form(_spec(runtime={"device": "cuda", "backend": "nccl"}))
    here, problems = sf.form_to_spec(v | {"run_here": True})
    assert not problems, problems
    assert (str(here.runtime.device), str(here.runtime.backend)) == ("auto", "auto")


def test_edit_as_new_submits_what_it_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    import streamlit as st

    st.cache_data.clear()
    at = AppTest.from_file(APP, default_timeout=60)
    at.session_state["clone_spec"] = _spec(train={"precision": "fp8", "fp8_all_gather": False}, strategy="ddp")
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    assert any("train.fp8_all_gather = false" in c.value for c in at.caption)
    at.button(key="submit_one").click().run()
    assert not at.exception, [e.message for e in at.exception]
    from db import queries
    from db.session import open_db

    stored = queries.get_experiment(open_db(f"sqlite:///{tmp_path / 'ui.db'}"), 1)["spec"]
    assert stored.train.precision == "fp8" and stored.train.fp8_all_gather is False


def test_an_uploaded_config_keeps_its_norm_epsilon_as_the_cli_does(tmp_path, monkeypatch):
    """`--hf-config` keeps a config's rms_norm_eps; the form's upload dropped it (1e-5 instead of DeepSeek-V3's 1e-6).
    A loaded spec's other kept fields stay; a preset picked after the upload drops the config's."""
    import json

    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    at = AppTest.from_file(APP, default_timeout=60)
    at.session_state["clone_spec"] = _spec(runtime={"backend": "gloo"}, strategy="ddp")
    at.run()
    cfg = (Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "deepseek-v3.json").read_bytes()
    at.file_uploader(key="hf_upload").upload("config.json", cfg, "application/json")
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    assert at.session_state["f_kept"] == {"runtime": {"backend": "gloo"}, "model": {"norm_eps": 1e-6}}
    assert json.loads(cfg)["rms_norm_eps"] == 1e-6
    at.selectbox(key="f_preset").set_value(sf.DEFAULT_PRESET).run()
    assert at.session_state["f_kept"] == {"runtime": {"backend": "gloo"}}
