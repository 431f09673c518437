"""Issue 30 item 1 on the dashboard (AppTest, the real upload widgets): a Megatron-LM launch script imports from the
Import config box; a script without a vocabulary size is asked for one in the page's own words, with a field (or the
model's config.json); the model-file box is not labelled for DeepSpeed only; the summary names every degree."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parents[2] / "app.py")
FIX = Path(__file__).resolve().parents[1] / "fixtures"
MIXTRAL = FIX / "imports" / "megatron_examples" / "mixtral" / "train_mixtral_8x7b_distributed.sh"


@pytest.fixture(autouse=True)
def ui_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    import streamlit as st

    st.cache_data.clear()


def _ok(at: AppTest) -> AppTest:
    assert not at.exception, [e.message for e in at.exception]
    return at


def _texts(at: AppTest) -> str:
    parts = [e.value for kind in ("error", "info", "success", "warning", "markdown", "caption", "text")
             for e in at.get(kind)]
    return "\n".join(str(p) for p in parts)


def _asked(at: AppTest) -> bool:
    return any("vocabulary size" in w.value for w in at.warning)


def _upload(at: AppTest, path: Path, *, gpus: int = 0, model: Path | None = None) -> AppTest:
    at.file_uploader(key="ne_imp_cfg").set_value((path.name, path.read_bytes(), "text/plain"))
    if model is not None:
        at.file_uploader(key="ne_imp_model").set_value((model.name, model.read_bytes(), "application/json"))
    at.number_input(key="ne_imp_gpus").set_value(gpus)
    _ok(at.run())
    return _ok(at.button(key="ne_imp_go").click().run())


@pytest.mark.heavy
def test_a_megatron_script_without_a_vocabulary_is_asked_for_one_in_the_pages_words():
    """Before: the error told a dashboard user to 'add --vocab-size N to the arguments or give the model's config.json
    with --model-config' (CLI flags). Now the page asks, and a field takes the answer."""
    at = _upload(_ok(AppTest.from_file(APP, default_timeout=60).run()), MIXTRAL, gpus=32)
    warning = " ".join(w.value for w in at.warning)
    assert "does not say its vocabulary size" in warning and "upload the model's config.json" in warning
    text = _texts(at)
    assert "--vocab" not in text and "--model-config" not in text and not at.error  # no CLI flag, no error box
    assert at.button(key="ne_imp_vocab_go").disabled
    at.number_input(key="ne_imp_vocab").set_value(32000)
    _ok(at.run())
    _ok(at.button(key="ne_imp_vocab_go").click().run())
    text = _texts(at)
    assert "megatron (megatron-args), 32 GPUs = dp 8 x cp 1 x tp 1 x pp 4, ep 8: zero1" in text
    assert not _asked(at)
    _ok(at.button(key="ne_imp_load").click().run())
    assert at.number_input(key="f_world_size").value == 32 and at.number_input(key="f_vocab_size").value == 32000


def test_the_model_config_json_gives_the_vocabulary_and_is_not_labelled_for_deepspeed_only():
    at = _ok(AppTest.from_file(APP, default_timeout=60).run())
    box = at.file_uploader(key="ne_imp_model")
    assert box.label == "Model config.json (optional)" and "DeepSpeed" not in box.label
    assert "Megatron" in box.help and "DeepSpeed" in box.help
    at = _upload(at, MIXTRAL, gpus=32, model=FIX / "hf" / "mixtral-8x7b.json")
    assert not _asked(at) and not at.error
    assert "32 GPUs = dp 8 x cp 1 x tp 1 x pp 4, ep 8" in _texts(at)


def test_the_import_summary_names_the_context_parallel_degree():
    """The 70B fixture is tp 8 x pp 4 x cp 2 x dp 2 on 128 GPUs; the summary said 'dp 2 x tp 8 x pp 4'."""
    at = _upload(_ok(AppTest.from_file(APP, default_timeout=60).run()), FIX / "imports" / "megatron_llama2_70b.sh")
    assert "128 GPUs = dp 2 x cp 2 x tp 8 x pp 4, ep 1: zero1" in _texts(at)


@pytest.mark.heavy
def test_a_script_that_is_not_gpt_like_is_refused_in_an_error_box():
    at = _upload(_ok(AppTest.from_file(APP, default_timeout=60).run()),
                 FIX / "imports" / "megatron_examples" / "bert" / "train_bert_340m_distributed.sh")
    assert at.error and any("pretrain_bert.py trains a BERT encoder" in t.value for t in at.text)
    assert not _asked(at)
