"""Dashboard side of issue 12: published presets, HF config upload logic, "run it here", source kept with the
spec, and the math-vs-flash activation comparison on the New-experiment page."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from backend.analytic.params import count_params
from backend.hf.config import HFConfigError, parsed_fields
from dashboard import spec_form as sf

APP = str(Path(__file__).resolve().parents[2] / "app.py")
HF = Path(__file__).parents[1] / "fixtures" / "hf"


def _form(**over):
    v = sf.default_form()
    v.update(over)
    return v


def test_published_preset_keeps_count_and_source():
    v = _form(**sf.apply_preset(sf.preset_label("mixtral-8x7b")))
    spec, problems = sf.form_to_spec(v)
    assert problems == [] and count_params(spec.model) == 46_702_792_704
    assert spec.model.source == {"preset": "mixtral-8x7b"}
    v["n_layers"] = 2
    assert sf.form_to_spec(v)[0].model.source == {"preset": "mixtral-8x7b", "edited": True}


def test_an_edit_after_edit_as_new_marks_the_loaded_source_edited():
    """Before, a loaded spec's shape could be edited and stored under its preset's name as if unchanged."""
    spec, problems = sf.form_to_spec(_form(**sf.apply_preset(sf.preset_label("mixtral-8x7b"))))
    assert problems == [], problems
    v = sf.spec_to_form(spec)
    assert sf.form_to_spec(v)[0].model.source == {"preset": "mixtral-8x7b"}
    v["n_layers"] = 2
    assert sf.form_to_spec(v)[0].model.source == {"preset": "mixtral-8x7b", "edited": True}


def test_run_here_scales_down_keeping_the_family():
    v = _form(**(sf.apply_preset(sf.preset_label("qwen1.5-moe-a2.7b"))
                 | dict(run_here=True, strategy="ep", world_size=2)))
    spec, problems = sf.form_to_spec(v)
    assert problems == [], problems
    m = spec.model
    assert (str(m.norm), str(m.mlp), str(m.bias), m.n_shared_experts,
            m.shared_expert_gate) == ("rmsnorm", "swiglu", "qkv", 1, True)
    assert count_params(m) < 5_000_000 and m.source["scaled_for_cpu"]


def test_hf_upload_values_and_refusal():
    cfg = json.loads((HF / "llama-3-8b.json").read_text())
    values, notes = sf.apply_hf_config(cfg, file="config.json", seq_len=8192)
    spec, problems = sf.form_to_spec(_form(**values))
    assert problems == [] and count_params(spec.model) == 8_030_261_248
    # issue 21: the run keeps the config's parsed fields, not the whole uploaded file
    assert spec.model.source["hf_config"] == parsed_fields(cfg) and spec.model.source["file"] == "config.json"
    with pytest.raises(HFConfigError, match="use_parallel_residual"):
        sf.apply_hf_config(json.loads((HF / "pythia-160m.json").read_text()), file="pythia.json")


def test_spec_round_trips_through_the_form():
    v = _form(**(sf.apply_preset(sf.preset_label("llama-3-8b")) | {"attention": "flash"}))
    spec, _ = sf.form_to_spec(v)
    back, problems = sf.form_to_spec(sf.spec_to_form(spec))
    assert problems == [] and back.model == spec.model


def test_attention_comparison_flash_saves_the_scores():
    v = _form(**(sf.apply_preset(sf.preset_label("llama-2-7b")) | dict(world_size=8, strategy="zero3", micro_batch=1,
                                                                         global_batch=8, precision="bf16-mixed")))
    spec, problems = sf.form_to_spec(v)
    assert not problems, problems
    cmp = sf.attention_comparison(spec)
    # math keeps the (b, a, s, s) bf16 probabilities and the (s, s) bool mask per layer (Korthikanti 2022's 5as/h
    # term, without dropout); flash keeps a (b, a, s) fp32 logsumexp instead (Dao et al. 2022)
    L, a, s, b = 32, 32, 4096, 1
    assert cmp["math"] - cmp["flash"] == L * (a * s * s * b * 2 + s * s - 4 * a * s * b)


def test_new_experiment_page_shows_source_and_flash_difference(monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.selectbox(key="f_preset").set_value(sf.preset_label("llama-2-7b")).run()
    assert not at.exception, [e.message for e in at.exception]
    captions = " ".join(c.value for c in at.caption)
    assert "Model source: llama-2-7b" in captions
    labels = [m.label for m in at.metric]
    assert "flash attention" in labels and "flash saves" in labels  # activations of the fullest rank, by kernel
    at.toggle(key="f_run_here").set_value(True).run()
    assert not at.exception
