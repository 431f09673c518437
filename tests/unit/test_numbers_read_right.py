"""Numbers that read wrong (issue 30 item 9): sizes in human units and the file's own, whole tokens/s, the navigation
in the workflow's order, a throughput line only within one series, a saving that is never negative, and no pydantic
serializer warnings (the server log's `attention` ones)."""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

from dashboard import compare_view as cv
from dashboard import predict_view as pv
from tests.helpers.store_helpers import fake_result, spec

ROOT = Path(__file__).resolve().parents[2]


def test_an_oversized_upload_is_reported_at_its_own_size_in_mib():
    """A 5.2 MB binary file with Megatron flags in front was "9,430,716 bytes": each undecodable byte counted as the
    3 bytes of the U+FFFD that replaced it, and nothing said how much that is."""
    from dashboard import import_view as iv

    data = b"torchrun pretrain_gpt.py --num-layers 2 " + bytes(range(128, 256)) * 40_625
    assert len(data) == 5_200_040
    _, problems = iv.import_uploaded(data, "x.sh", fmt=None, gpus=None, model_config=None)
    assert problems == ["the argument list is 4.96 MiB (5,200,040 bytes), over the 1,048,576-byte limit (1 MiB)"]


@pytest.mark.parametrize("module, what", [("torchtitan_toml", "TOML"), ("nemo_yaml", "YAML")])
def test_config_size_limits_speak_mib(module, what):
    import importlib

    parse = importlib.import_module(f"backend.importers.{module}").parse
    from backend.importers import ConfigImportError

    with pytest.raises(ConfigImportError) as e:
        parse(b"x" * 3_000_000)
    assert e.value.problems == [f"the {what} is 2.86 MiB (3,000,000 bytes), over the 1,048,576-byte limit (1 MiB) for "
                                "a config"]


def test_tokens_per_second_are_whole_numbers():
    from dashboard import runs_view as rv

    df = rv.table_frame([{"id": 1, "status": "ok", "strategy": "ddp", "world_size": 2, "dp": 2, "tags": [],
                          "tokens_per_s": 12345.6789}])
    assert df.loc[0, "tokens/s"] == 12346
    from dashboard import plan_view

    plan = plan_view.run_plan(plan_view.ModelSpec(**{**plan_view.LLAMA70B, "seq_len": 4096}), gpus=64, gpus_per_node=8,
                              hardware="h100-sxm", global_batch=128, memory_gb=None, top=3)
    tokens = plan_view.results_frame(plan)["tokens/s"]
    assert all(float(t) == int(t) for t in tokens) and any(c["step_time"]["tokens_per_s"] % 1 for c in plan.configs)


def test_the_navigation_lists_the_workflow_pages_in_the_workflow_order():
    from dashboard.workflow import STEPS

    tree = ast.parse((ROOT / "app.py").read_text())
    pages = [n.args[0].value for n in ast.walk(tree)
             if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "Page"
             and not any(k.arg == "visibility" for k in n.keywords)]
    order = [p for p in pages if p in {s[0] for s in STEPS}]
    assert order == list(dict.fromkeys(s[0] for s in STEPS)) and pages[0] == "dashboard/pages/plan.py", pages


def _run(eid: int, name: str, world: int, d_model: int = 32, strategy: str = "ddp", tokens: float = 100.0) -> dict:
    from backend.spec import ExperimentSpec

    data = spec(name, strategy=strategy).model_dump(mode="json")
    data["model"]["d_model"], data["train"]["global_batch"] = d_model, 2 * world
    data["parallel"].update(world_size=world, dp=None)
    s = ExperimentSpec.model_validate(data)
    res = fake_result(s)
    res.tokens_per_s = tokens
    return {"id": eid, "status": "ok", "spec": s, "result": res}


def test_throughput_joins_only_runs_of_one_series():
    """Two unrelated ddp runs (other model widths) were one line; runs of one model at worlds 2 and 4 are one series."""
    unrelated = [_run(1, "a", 2, d_model=32, tokens=100.0), _run(2, "b", 4, d_model=64, tokens=50.0)]
    fig = cv.throughput_fig(unrelated)
    assert [(t.name, t.mode, len(t.x)) for t in fig.data] == [("ddp · #1", "markers", 1), ("ddp · #2", "markers", 1)]
    series = [_run(3, "w2", 2, tokens=100.0), _run(4, "w4", 4, tokens=180.0), _run(5, "z", 2, strategy="zero2")]
    fig = cv.throughput_fig(series)
    assert [(t.name, t.mode, tuple(t.x)) for t in fig.data] == [("ddp", "lines+markers", (2, 4)),
                                                                ("zero2", "markers", (2,))]
    mem = cv.memory_scaling_fig(unrelated)  # one formula curve per series, from that series' own model
    assert [t.name for t in mem.data if t.name.endswith("formula")] == ["ddp · #1 formula", "ddp · #2 formula"]


def test_flash_never_saves_a_negative_amount():
    """Under op-level recompute flash keeps more than math (its kernel output and logsumexp are on the op list, math's
    matmuls are not): "flash saves −2.03 GiB" for an imported Llama-3-8B config. It says what flash keeps more, and
    why."""
    from backend.importers import import_config
    from backend.spec import ExperimentSpec
    from dashboard import spec_form as sf

    data = import_config(ROOT / "tests/fixtures/imports/torchtitan_llama3_8b.toml", gpus=8).spec
    data["train"]["recompute"] = "op"
    cmp = sf.attention_comparison(ExperimentSpec.for_prediction(data))
    assert cmp["flash"] - cmp["math"] > 2 * 2**30  # 2.03 GiB more
    label, value, why = pv.flash_saving(cmp, "op")
    assert label == "flash keeps more" and not value.startswith(("-", "−")) and "op-level recompute" in why
    assert pv.flash_saving({"math": 10 * 2**20, "flash": 4 * 2**20}, "none")[:2] == ("flash saves", "6 MiB")


def test_the_plan_and_the_pages_dump_specs_without_serializer_warnings(tmp_path, monkeypatch):
    """The Plan page planned with attention as a str in an enum field: every dump of those specs warned
    (PydanticSerializationUnexpectedValue ... field_name='attention'), filling the server log."""
    from backend.analytic.device import with_device
    from dashboard import plan_view

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = plan_view.run_plan(plan_view.ModelSpec(**{**plan_view.LLAMA70B, "seq_len": 4096}), gpus=64,
                                  gpus_per_node=8,
                                  hardware="h100-sxm", global_batch=128, memory_gb=None, top=3, attention="flash")
        plan_view.results_frame(plan)
        plan_view.spec_for_form(plan, 0).model_dump_json()
        with_device(spec("x"), "cuda").model_dump_json()
