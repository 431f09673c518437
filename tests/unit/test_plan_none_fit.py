"""A plan where no searched layout fits says so and how far off the closest layout is (its fullest moment and need,
the numbers `estimate` gives for it, against the device), and how many GPUs of this kind the model states alone
need; the CLI, `--json` ("none_fit") and the Plan page say the same. Before: an empty table, exit 0, no reason."""

from __future__ import annotations

import json
import math

import pytest

from backend.analytic.estimate import worst_rank_bytes
from backend.analytic.steptime.hardware import get_hardware
from backend.cli import main
from backend.planner.search import plan
from backend.planner.space import light_spec
from backend.presets import preset_model
from backend.spec import ModelSpec
from dashboard import plan_view as pv

ARGS = ["plan", "--hardware", "h100-sxm", "--seq", "4096", "--preset", "llama-3.1-405b", "--gpus", "8",
        "--global-batch", "32"]


@pytest.fixture(scope="module")
def res():
    model = ModelSpec(**{**preset_model("llama-3.1-405b"), "seq_len": 4096, "attention": "flash"})
    return plan(model, gpus=8, gpus_per_node=8, hw=get_hardware("h100-sxm"), global_batch=32, top=5)


def test_nothing_fits_names_the_closest_layout_with_estimates_numbers(res):
    assert res.searched > 0 and res.feasible == 0 and not res.configs
    nf = res.none_fit
    assert nf is not None and nf["device_bytes"] == res.device_bytes
    worst, rank = worst_rank_bytes(light_spec(nf["spec"]))  # estimate's own core on that layout alone
    assert nf["mem_bytes_max"] == worst and nf["fullest_moment"] == rank.fullest_moment()
    assert nf["need_bytes"] > nf["device_bytes"] and nf["over_bytes"] == pytest.approx(nf["need_bytes"]
                                                                                         - nf["device_bytes"])
    states = nf["states"]
    assert states["total_bytes"] == pytest.approx(states["per_gpu_bytes"] * 8)
    assert states["gpus_needed"] == math.ceil(states["total_bytes"] / states["room_bytes"]) > 8


def test_cli_says_why_and_json_carries_it(capsys):
    assert main(ARGS) == 0
    out = capsys.readouterr().out
    assert "No layout fits" in out and "closest" in out and "at least" in out
    assert main([*ARGS, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["configs"] == [] and data["none_fit"]["states"]["gpus_needed"] > 8
    assert data["none_fit"]["text"].startswith("No layout fits")


def test_plan_page_says_the_same(res):
    assert pv.nothing_ranked(res) == res.none_fit["text"]
