"""'Run it here' shows what runs (issue 20 item 10): the scaled-down shape beside the full one, the GQA change said
out loud, and the run named after the scaled shape."""

from __future__ import annotations

import os
from pathlib import Path

from streamlit.testing.v1 import AppTest

from backend.ui import spec_form as sf

APP = str(Path(__file__).resolve().parents[1] / "app.py")


def test_run_it_here_shows_and_names_the_scaled_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    at = AppTest.from_file(APP, default_timeout=60).run()
    at.selectbox(key="f_preset").set_value(sf.preset_label("llama-3-70b")).run()
    at.toggle(key="f_run_here").set_value(True).run()
    assert not at.exception, [e.message for e in at.exception]
    shape = next(d.value for d in at.dataframe if "runs here" in d.value.columns).set_index("field")
    assert (shape.loc["hidden size h", "full size"], shape.loc["hidden size h", "runs here"]) == ("8,192", "64")
    assert (shape.loc["layers L", "full size"], shape.loc["layers L", "runs here"]) == ("80", "2")
    assert shape.loc["KV heads", "runs here"] == "4 (no GQA)"
    assert shape.loc["parameters", "runs here"] == f"{151_872:,}"
    assert any("8 query heads per KV head do not divide the 4 heads" in c.value for c in at.caption)
    at.button(key="submit_one").click().run()
    assert not at.exception
    from db import queries
    from db.session import open_db

    spec = queries.get_experiment(open_db(os.environ["SHARDLAB_DB_URL"]), 1)["spec"]
    assert spec.name == "llama-3-70b scaled for CPU: h64 L2 a4"
    assert (spec.model.d_model, spec.model.n_layers, spec.model.source["scaled_for_cpu"]) == (64, 2, True)
