"""Plan page (AppTest): the fit rule's allowance fields, the twins of `plan --reserve-gb / --fragmentation` (issue 32):
passed through to the planner, shown with the plan, and refused with the CLI's own check before anything is
searched."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from dashboard import plan_view as pv
from dashboard import spec_form as sf

APP = str(Path(__file__).resolve().parents[2] / "app.py")


@pytest.fixture(autouse=True)
def ui_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")


@pytest.fixture
def planned(monkeypatch) -> list[dict]:
    """The keyword arguments of every plan() the page makes (the real planner still runs)."""
    calls: list[dict] = []
    real = pv.plan

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(pv, "plan", spy)
    return calls


def _small(at: AppTest) -> AppTest:
    at.switch_page("dashboard/pages/plan.py").run()
    at.selectbox(key="pl_preset").set_value(sf.preset_label("gpt2")).run()
    at.number_input(key="pl_seq").set_value(1024)
    at.number_input(key="pl_gpus").set_value(8)
    at.number_input(key="pl_batch").set_value(32)
    return at


def _errors(at: AppTest) -> str:
    return " ".join(e.value for e in at.error)


@pytest.mark.heavy
def test_reserve_and_slack_reach_the_planner_and_the_page_shows_the_allowance_used(planned):
    at = _small(AppTest.from_file(APP, default_timeout=120).run())
    assert at.number_input(key="pl_reserve").value is None and at.number_input(key="pl_slack").value == 0.13
    at.button(key="pl_go").click().run()
    assert not at.exception and planned[-1]["reserve_bytes"] is None and planned[-1]["fragmentation"] == 0.13
    assert any("the CUDA context (527 MiB) + NCCL buffers (64 MiB per communicator) + allocator slack (13% of the "
               "fullest moment)" in c.value for c in at.caption)
    at.number_input(key="pl_reserve").set_value(2.0)
    at.number_input(key="pl_slack").set_value(0.25)
    at.button(key="pl_go").click().run()
    assert not at.exception and len(planned) == 2
    assert planned[-1]["reserve_bytes"] == 2e9 and planned[-1]["fragmentation"] == 0.25
    res = at.session_state["pl_result"]
    assert (res.overhead.cuda_context_bytes, res.overhead.nccl_bytes_per_communicator()) == (2_000_000_000, 0)
    assert res.configs and all(c["need_bytes"] == pytest.approx(1.25 * c["mem_bytes_max"] + 2e9) for c in res.configs)
    assert any("+ a reserve of 2 GB per GPU (in place of the CUDA context and NCCL buffers) + allocator slack (25% of "
               "the fullest moment)" in c.value for c in at.caption)
    assert not any(w.value.startswith("Press Search for the inputs above") for w in at.warning)
    at.number_input(key="pl_slack").set_value(0.2).run()  # the results say what they were for
    assert any(w.value.startswith("Press Search for the inputs above") for w in at.warning)


@pytest.mark.parametrize(("reserve", "slack", "said"), [
    (None, 1.5, "Allocator slack must be between 0 and 1, a fraction of the fullest moment (0.13 adds 13%); got 1.5"),
    (None, -0.1, "Allocator slack must be between 0 and 1"),
    (-1.0, 0.13, "Reserve per GPU must be >= 0 GB per GPU (got -1)"),
    (85.0, 0.13, "Reserve per GPU 85 GB is not less than the 84.94 GB per GPU of h100-sxm: no layout could fit")])
@pytest.mark.heavy
def test_a_bad_allowance_is_refused_with_the_clis_words_and_nothing_is_planned(planned, reserve, slack, said):
    at = _small(AppTest.from_file(APP, default_timeout=120).run())
    at.number_input(key="pl_reserve").set_value(reserve)
    at.number_input(key="pl_slack").set_value(slack)
    at.run()
    assert not at.exception and said in _errors(at)
    assert at.button(key="pl_go").disabled  # a browser cannot press it (AppTest refuses to, too)
    assert not planned and "pl_result" not in at.session_state
