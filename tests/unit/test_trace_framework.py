"""A DeepSpeed or JAX spec is not traced as if it were the torch engine's (the trace runs ShardLab's own engine,
whose layout is not the framework's): it is refused as unsupported, with the reason, before any rank starts."""

from __future__ import annotations

import pytest

from backend.spec import ExperimentSpec
from backend.trace.trace_spec import trace_spec


def _spec(framework: str) -> ExperimentSpec:
    strategy = "tp" if framework == "jax" else "zero3"
    return ExperimentSpec.model_validate({
        "framework": framework, "model": {"n_layers": 2, "d_model": 64, "n_heads": 4},
        "parallel": {"strategy": strategy, "world_size": 2, **({"tp": 2} if strategy == "tp" else {})},
        "train": {"steps": 2}})


@pytest.mark.parametrize("framework", ["deepspeed", "jax"])
def test_a_non_torch_framework_is_unsupported_not_traced_as_torch(framework: str) -> None:
    def never(*_a):
        raise AssertionError("no rank is traced for a framework the trace does not run")

    out = trace_spec(_spec(framework), rank_runner=never)
    assert out["status"] == "unsupported"
    assert f"framework {framework}" in out["error"] and "--framework torch" in out["error"]
    assert out["per_rank"] == [] and out["kind"] == "traced"


def test_the_form_disables_trace_for_a_deepspeed_spec_with_the_reason(tmp_path, monkeypatch) -> None:
    """New experiment's "Trace at full size" would store a failed run for a DeepSpeed spec: it is disabled with the
    trace's own reason, and enabled again for framework torch."""
    from pathlib import Path

    import streamlit as st
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    st.cache_data.clear()
    at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "app.py"), default_timeout=60).run()
    at.selectbox(key="f_strategy").set_value("zero3").run()
    assert not at.button(key="trace_full").disabled
    at.selectbox(key="f_framework").set_value("deepspeed").run()
    assert not at.exception
    button = at.button(key="trace_full")
    assert button.disabled and "framework deepspeed: the trace runs ShardLab's own torch engine" in button.help
