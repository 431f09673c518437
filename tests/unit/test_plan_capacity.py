"""Issue 35: `plan` searches the expert capacity factor of a MoE model (`--capacity-factors none,1.0,1.25`, the Plan
page's multiselect), through the same core as `estimate` (planner/capacity.py: each factor is the model with that
factor); each layout row carries `capacity_factor` and its predicted dropped share, and a note says that a factor
drops tokens. Kept cheap: a small MoE on 8 GPUs, a handful of layouts compared with `estimate`."""

from __future__ import annotations

import json

import pytest

from backend.analytic.estimate import worst_rank_bytes
from backend.analytic.steptime.hardware import get_hardware
from backend.cli import main
from backend.planner.capacity import NOTE_PREFIX, candidates, parse_capacity_factors, with_factor
from backend.planner.search import plan, search
from backend.planner.space import light_spec
from backend.planner.why import explain_first
from backend.spec import ModelSpec
from dashboard import plan_view as pv

HW = get_hardware("h100-sxm")
# a small MoE (Mixtral's routing, 8 experts top-2) padded to capacity at its own factor 1.0: a dropless candidate
# then drops the padding, a factor 2 doubles the padded rows, a factor 0.5 drops half the slots
MOE = ModelSpec(vocab_size=32000, d_model=1024, n_layers=4, n_heads=16, n_kv_heads=4, ffn_hidden=3584, seq_len=2048,
                n_experts=8, top_k=2, norm="rmsnorm", mlp="swiglu", positions="rope", bias="none",
                attention="flash", capacity_factor=1.0, moe_pad_to_capacity=True)
KW = dict(gpus=8, gpus_per_node=8, hw=HW, global_batch=64)


def test_parse_capacity_factors_and_the_candidates():
    assert parse_capacity_factors("none, 1.0,1.25,dropless,1") == ((None, 1.0, 1.25), None)
    for bad, words in (("1.0,abc", "'abc' is neither a number nor none"), ("0", "out of range"),
                       ("1,,2", "'' is neither"), ("2000", "out of range"), ("nan", "out of range")):
        factors, problem = parse_capacity_factors(bad)
        assert factors == () and words in problem, bad
    assert candidates(MOE, None) == (1.0,)  # the default: the model's own, one search as before
    assert candidates(MOE, (1.25, None, 0.5, 1.0)) == (None, 1.25, 1.0, 0.5)  # dropless first: ties go to it
    assert with_factor(MOE, 1.0) is MOE
    dropless = with_factor(MOE, None)
    assert dropless.capacity_factor is None and not dropless.moe_pad_to_capacity  # dropless cannot pad
    assert with_factor(MOE, 2.0).moe_pad_to_capacity


def _estimate(spec: dict, tmp_path, capsys) -> dict:
    path = tmp_path / "layout.json"
    path.write_text(json.dumps(spec))
    assert main(["estimate", "--spec", str(path), "--hardware", "h100-sxm", "--gpus-per-node", "8", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.heavy
def test_plan_prices_each_capacity_factor_as_estimate_does(tmp_path, capsys):
    """Each planned layout with a capacity factor has estimate's fullest moment, to the byte, and its step time, for
    the same spec; the array path (search on the model at that factor) has the same bytes; the factor changes the
    prediction: on the same ep layout, padding to factor 2 costs memory and time, factor 0.5 saves time."""
    res = plan(MOE, top=12, include_predicted=True, capacity_factors=(None, 2.0, 1.0, 0.5), **KW)
    assert res.capacity_factors == [None, 2.0, 1.0, 0.5] and not [n for n in res.notes if "disagree" in n]
    assert {c["capacity_factor"] for c in res.configs} >= {0.5}
    checked = [c for c in res.configs if c["spec"]["parallel"]["ep"] > 1 and c["capacity_factor"] is not None][:3]
    assert checked
    for c in checked:
        assert c["spec"]["model"]["capacity_factor"] == c["capacity_factor"]
        out = _estimate(c["spec"], tmp_path, capsys)
        assert out["fit"]["fullest_bytes"] == c["mem_bytes_max"], c["spec"]["name"]
        assert out["step_time"]["step_s"] == c["step_time"]["step_s"], c["spec"]["name"]
    # the same ep layout at each factor: the array path is the single layout's, and the factor moves it
    ep_layout = next(c for c in res.configs if c["spec"]["parallel"]["ep"] > 1)["spec"]
    by_factor = {}
    for factor in (None, 2.0, 0.5):
        model = with_factor(MOE, factor)
        layouts, memory, _ = search(model, memory_bytes=HW.memory_bytes, prune=False, **KW)
        i = next(i for i in range(len(layouts)) if _same_layout(layouts.take(i).spec_dict(model), ep_layout))
        data = layouts.take(i).spec_dict(model)
        assert memory[i] == worst_rank_bytes(light_spec(data))[0]
        by_factor[factor] = (memory[i], _estimate(data, tmp_path, capsys)["step_time"]["step_s"])
    assert by_factor[2.0][0] > by_factor[None][0] and by_factor[2.0][1] > by_factor[None][1]
    assert by_factor[0.5][1] < by_factor[None][1]


def _same_layout(a: dict, b: dict) -> bool:
    return a["parallel"] == {k: b["parallel"][k] for k in a["parallel"]} and all(
        a["train"][k] == b["train"][k] for k in ("micro_batch", "recompute"))


def test_default_plan_is_the_models_own_factor_and_rows_carry_it():
    """Without capacity_factors the plan is the one search of the model as given (names without a factor), and each
    row still says its capacity factor; asking for the model's own factor alone gives the same plan."""
    res = plan(MOE, top=4, **KW)
    same = plan(MOE, top=4, capacity_factors=(1.0,), **KW)
    assert res.capacity_factors == [1.0] and res.searched == same.searched
    assert [c["spec"] for c in res.configs] == [c["spec"] for c in same.configs]
    assert all(c["capacity_factor"] == 1.0 and not c["spec"]["name"].endswith("cf 1") for c in res.configs)
    assert all(c["predicted_dropped_share"] == 0.0 for c in res.configs)  # uniform routing: 1.0 drops nothing


def test_a_dropping_layout_is_noted_with_its_predicted_share():
    res = plan(MOE, top=6, capacity_factors=(None, 0.5), **KW)
    assert {c["capacity_factor"] for c in res.configs} <= {None, 0.5}
    dropping = [c for c in res.configs if c["capacity_factor"] == 0.5]
    assert dropping and all(c["spec"]["name"].endswith(" cf 0.5") for c in dropping)
    assert all(c["predicted_dropped_share"] == pytest.approx(0.5, abs=1e-3) for c in dropping)
    assert all(c["predicted_dropped_share"] is None for c in res.configs if c["capacity_factor"] is None)
    note = next(n for n in res.notes if n.startswith(NOTE_PREFIX))
    assert "what the model learns" in note and "50.0% predicted dropped" in note and "uniform routing" in note
    # the page: the columns, the caption, and the spec opened in New experiment
    df = pv.results_frame(res)
    assert "capacity factor" in df and "dropped %" in df and pv.capacity_note(res).startswith("Capacity factor: ")
    assert not any(n.startswith(NOTE_PREFIX) for n in pv.other_notes(res))
    i = res.configs.index(dropping[0])
    assert pv.spec_for_form(res, i).model.capacity_factor == 0.5
    assert "capacity factor" not in pv.results_frame(plan(MOE.model_copy(update={"capacity_factor": None,
                                                                                  "moe_pad_to_capacity": False}),
                                                           top=2, **KW))


def test_why_first_walks_the_capacity_factor():
    """#2 is #1's layout at another factor: the walk's one step is the factor, and the parts add up."""
    import copy

    from backend.analytic.steptime.model import step_time
    from backend.spec import ExperimentSpec

    res = plan(MOE, top=6, capacity_factors=(0.5,), **KW)
    fast = next(c for c in res.configs if c["spec"]["parallel"]["ep"] > 1)
    slow = {"spec": copy.deepcopy(fast["spec"])}
    slow["spec"]["model"]["capacity_factor"] = 2.0
    slow["step_time"] = step_time(ExperimentSpec.for_prediction(slow["spec"]), HW, gpus_per_node=8).summary
    why = explain_first([fast, slow], HW, 8)
    assert [s["change"] for s in why["by_choice"]] == ["capacity factor 2 padded instead of capacity factor 0.5 padded"]
    assert why["by_choice"][0]["seconds"] == pytest.approx(why["difference_s"]) and why["difference_s"] > 0


def test_plan_cli_capacity_factors(capsys, tmp_path):
    base = ["plan", "--gpus", "8", "--hardware", "h100-sxm", "--global-batch", "64", "--seq", "2048", "--top", "3"]
    moe = ["--layers", "4", "--hidden", "1024", "--heads", "16", "--kv-heads", "4", "--ffn", "3584", "--vocab", "32000",
           "--experts", "8", "--top-k", "2"]
    assert main([*base, *moe, "--capacity-factors", "none,1.x"]) == 2
    err = capsys.readouterr().err
    assert "'1.x' is neither a number nor none" in err and "Traceback" not in err
    assert main([*base, "--preset", "llama-3-8b", "--capacity-factors", "1.0"]) == 2
    assert "mixture-of-experts models only" in capsys.readouterr().err
    assert main([*base, *moe, "--capacity-factors", "none,0.5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["capacity_factors"] == [None, 0.5] and all("capacity_factor" in c for c in out["configs"])
    if any(c["capacity_factor"] == 0.5 for c in out["configs"]):
        assert any(n.startswith(NOTE_PREFIX) for n in out["notes"])


def test_step_time_memos_key_on_the_capacity_factor():
    """The step-time model's memo of a stage's weight GEMMs and the screen's per-layer GEMMs were keyed on the
    parameter shapes, top_k and ep but not on the expert rows' capacity factor, padding and imbalance: a spec timed
    after the same layout at another factor took that factor's seconds (plan dp8·ep8 zero1 at cf 0.5: 0.0556 s after
    a dropless search, 0.0484 s alone). Each factor now times as in a fresh process (a fresh profile object)."""
    import dataclasses

    from backend.analytic.steptime.model import step_time
    from backend.analytic.steptime.screen import screen_step_s
    from backend.planner.space import enumerate_layouts

    hw = dataclasses.replace(HW, memo={})
    spec = {"model": MOE.model_dump(mode="json"), "train": {"global_batch": 64, "micro_batch": 1},
            "parallel": {"strategy": "zero1", "world_size": 8, "dp": 8, "ep": 8}, "runtime": {"device": "cuda"}}
    layouts = enumerate_layouts(MOE, gpus=8, gpus_per_node=8, global_batch=64, device="cuda")
    for factor in (None, 2.0, 0.5):
        spec["model"].update(capacity_factor=factor, moe_pad_to_capacity=factor is not None)
        model = with_factor(MOE, factor)
        warm = step_time(light_spec(spec), hw, gpus_per_node=8).summary["step_s"]
        warm_screen = screen_step_s(model, layouts, hw, gpus_per_node=8)
        fresh = dataclasses.replace(HW, memo={})
        assert warm == step_time(light_spec(spec), fresh, gpus_per_node=8).summary["step_s"], factor
        assert (warm_screen == screen_step_s(model, layouts, fresh, gpus_per_node=8)).all(), factor


@pytest.mark.heavy
def test_plan_page_capacity_multiselect_for_moe_models_only(tmp_path, monkeypatch):
    """The Plan page offers the capacity factors for a MoE model (the model's own picked), none for a dense one; a
    search with two factors shows the column and the caption on dropped tokens."""
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    from dashboard import spec_form as sf

    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "app.py"), default_timeout=180).run()
    at.switch_page("dashboard/pages/plan.py").run()
    at.selectbox(key="pl_preset").set_value(sf.preset_label("gpt2")).run()
    assert not at.exception and not [w for w in at.multiselect if w.key == "pl_capacity"]
    at.selectbox(key="pl_preset").set_value(sf.preset_label("qwen1.5-moe-a2.7b")).run()
    assert at.multiselect(key="pl_capacity").value == [None]
    at.number_input(key="pl_seq").set_value(1024)
    at.number_input(key="pl_gpus").set_value(8)
    at.number_input(key="pl_batch").set_value(16)
    at.slider(key="pl_top").set_value(4)
    at.multiselect(key="pl_capacity").set_value([None, 0.5]).run()
    at.button(key="pl_go").click().run()
    assert not at.exception
    df = at.dataframe[0].value
    assert "capacity factor" in df and set(df["capacity factor"]) <= {"dropless", "0.5"}
    if "0.5" in set(df["capacity factor"]):
        assert any(c.value.startswith("Capacity factor: ") for c in at.caption)


@pytest.mark.heavy
def test_plan_page_dispatcher_select_plans_with_the_picked_dispatcher(tmp_path, monkeypatch):
    """A MoE model's Plan page offers Megatron's token dispatcher (the model's own picked); a search with flex plans
    every layout with it (prediction only on this engine, so the search includes prediction-only layouts)."""
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    from dashboard import spec_form as sf

    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "app.py"), default_timeout=180).run()
    at.switch_page("dashboard/pages/plan.py").run()
    at.selectbox(key="pl_preset").set_value(sf.preset_label("gpt2")).run()
    assert not at.exception and not [w for w in at.selectbox if w.key == "pl_dispatcher"]
    at.selectbox(key="pl_preset").set_value(sf.preset_label("qwen1.5-moe-a2.7b")).run()
    assert at.selectbox(key="pl_dispatcher").value == "alltoall"
    at.number_input(key="pl_seq").set_value(1024)
    at.number_input(key="pl_gpus").set_value(8)
    at.number_input(key="pl_batch").set_value(16)
    at.slider(key="pl_top").set_value(4)
    at.toggle(key="pl_predicted").set_value(True)
    at.selectbox(key="pl_dispatcher").set_value("flex").run()
    at.button(key="pl_go").click().run()
    assert not at.exception, [e.message for e in at.exception]
    res = at.session_state["pl_result"]
    assert res.configs and {c["spec"]["model"]["moe_dispatcher"] for c in res.configs} == {"flex"}
    assert "flex dispatcher" in at.session_state["pl_result_for"]
    at.selectbox(key="pl_preset").set_value(sf.preset_label("qwen3-30b-a3b")).run()  # another model: its own again
    assert not at.exception and at.selectbox(key="pl_dispatcher").value == "alltoall"
