"""Bad config.json files give one clear HFConfigError naming the field, never another exception (issue 20 item 3):
the importer under random, truncated and re-typed configs (hypothesis), and the CLI and both pages on the example."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs
from streamlit.testing.v1 import AppTest

from backend.cli import main
from backend.hf.config import FAMILIES, HFConfigError, from_hf_config, parse_hf_config
from backend.spec import ModelSpec

HF = Path(__file__).parents[1] / "fixtures" / "hf"
REAL = {p.name: json.loads(p.read_text()) for p in sorted(HF.glob("*.json"))}
MISSING_KEY = {"model_type": "llama", "hidden_size": 4096}  # the issue's example
APP = str(Path(__file__).resolve().parents[2] / "app.py")

JSON_VALUES = hs.recursive(hs.none() | hs.booleans() | hs.integers(-2**70, 2**70) | hs.floats() | hs.text(max_size=8),
                           lambda inner: hs.lists(inner, max_size=3)
                           | hs.dictionaries(hs.text(max_size=6), inner, max_size=3),
                           max_leaves=6)
KNOWN_KEYS = sorted({k for cfg in REAL.values() for k in cfg})


def _imports_or_refuses(cfg) -> None:
    try:
        fields, notes = from_hf_config(cfg, seq_len=None)
    except HFConfigError as e:
        assert str(e), "the error names what is wrong"
        return
    fields.pop("source")
    ModelSpec(**fields)  # whatever the importer accepts is a valid shape
    assert all(isinstance(n, str) for n in notes)


def test_the_issue_example_names_the_missing_field():
    with pytest.raises(HFConfigError, match="config.json lacks num_attention_heads, which model_type llama needs"):
        from_hf_config(MISSING_KEY)
    with pytest.raises(HFConfigError, match=r"hidden_size='4096' must be an integer >= 1"):
        from_hf_config({**REAL["llama-2-7b.json"], "hidden_size": "4096"})
    with pytest.raises(HFConfigError, match=r"vocab_size=20000000: .*less than or equal to 10000000 \(ShardLab's "
                                            r"vocab_size\)"):
        from_hf_config({**REAL["gpt2.json"], "vocab_size": 20_000_000})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=hs.sampled_from(FAMILIES) | hs.text(max_size=5) | JSON_VALUES,
       entries=hs.dictionaries(hs.sampled_from(KNOWN_KEYS) | hs.text(max_size=6), JSON_VALUES, max_size=12))
@pytest.mark.heavy
def test_random_configs_raise_only_the_importers_error(family, entries):
    _imports_or_refuses({**entries, "model_type": family})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=hs.sampled_from(sorted(REAL)), data=hs.data())
def test_truncated_and_retyped_real_configs_raise_only_the_importers_error(name, data):
    cfg = dict(REAL[name])
    keys = sorted(cfg)
    for key in data.draw(hs.lists(hs.sampled_from(keys), max_size=4, unique=True), label="dropped"):
        cfg.pop(key)
    for key in data.draw(hs.lists(hs.sampled_from(keys), max_size=3, unique=True), label="retyped"):
        cfg[key] = data.draw(JSON_VALUES, label=key)
    _imports_or_refuses(cfg)


@settings(max_examples=100, deadline=None)
@given(name=hs.sampled_from(sorted(REAL)), cut=hs.floats(0, 1, exclude_max=True))
def test_truncated_files_raise_only_the_importers_error(name, cut):
    text = (HF / name).read_text()
    try:
        cfg = parse_hf_config(text[:int(len(text) * cut)].encode(), name=name)
    except HFConfigError as e:
        assert name in str(e)
        return
    _imports_or_refuses(cfg)


def test_cli_prints_the_field_not_a_traceback(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(MISSING_KEY))
    assert main(["estimate", "--hf-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "lacks num_attention_heads" in err and "Traceback" not in err
    assert main(["plan", "--hf-config", str(bad), "--gpus", "8", "--hardware", "h100-sxm", "--global-batch", "8",
                 "--seq", "1024"]) == 2
    assert "lacks num_attention_heads" in capsys.readouterr().err


@pytest.fixture
def ui_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")


def test_pages_show_the_field_not_a_traceback(ui_env):
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.file_uploader(key="hf_upload").upload("config.json", json.dumps(MISSING_KEY).encode(), "application/json")
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    assert any("lacks num_attention_heads" in e.value for e in at.error)
    at.switch_page("dashboard/pages/plan.py").run()
    at.radio(key="pl_source").set_value("config.json").run()
    at.file_uploader(key="pl_cfg").upload("config.json", b"[1, 2]", "application/json")
    at.run()
    assert not at.exception, [e.message for e in at.exception]
    assert any("not a JSON object" in e.value for e in at.error)
    at.file_uploader(key="pl_cfg").upload("config.json", json.dumps(MISSING_KEY).encode(), "application/json")
    at.run()
    assert not at.exception and any("lacks num_attention_heads" in e.value for e in at.error)
