"""Planner: the fast worst-rank memory agrees with the exact estimator; the CLI's JSON contract; predict-only specs."""

from __future__ import annotations

import json
import random

import pytest

from backend.analytic.estimate import estimate, worst_rank_bytes
from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import STEP_KEYS
from backend.cli import main
from backend.planner.search import plan
from backend.planner.space import enumerate_layouts, light_spec
from backend.spec import ExperimentSpec, ModelSpec, validate_spec

MODEL = ModelSpec(vocab_size=1000, d_model=128, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=352, seq_len=64)


@pytest.mark.slow
def test_fast_memory_matches_exact_estimator_on_1000_random_layouts():
    """Issue 13: worst-rank memory of the planner's path within 0.5% of estimate.estimate on 1,000 random layouts
    (ddp/zero1/zero2/zero3 x tp x pp x schedules x micro-batch x recompute x SP, 8 and 16 GPUs)."""
    rng = random.Random(13)
    rows = [(g, lay.take(i)) for g in (8, 16) for lay in [enumerate_layouts(MODEL, gpus=g, gpus_per_node=8,
                                                                            global_batch=32)]
            for i in range(len(lay))]
    worst = 0.0
    for _, row in rng.sample(rows, 1000):
        data = row.spec_dict(MODEL)
        fast, _ = worst_rank_bytes(light_spec(data))
        # its fullest moment
        exact = max(r.fullest_bytes() for r in estimate(ExperimentSpec.for_prediction(data)).per_rank)
        worst = max(worst, abs(fast - exact) / exact)
        assert abs(fast - exact) <= 0.005 * exact, (row, fast, exact)
    assert worst <= 0.005


def test_predict_only_spec_keeps_run_checks():
    """ZeRO-1 x TP under fp16-mixed (the distributed optimizer has no fp16 loss scaling) can be predicted but is
    rejected for running; under bf16-mixed it runs."""
    d = {"parallel": {"strategy": "zero1", "world_size": 4, "tp": 2},
         "train": {"global_batch": 8, "micro_batch": 2, "precision": "fp16-mixed"}}
    spec, problems = validate_spec(d)
    assert spec is None and "fp16 loss scaling over its fp32 main-grad buffers" in problems[0]
    assert validate_spec({**d, "train": {**d["train"], "precision": "bf16-mixed"}})[0] is not None
    assert ExperimentSpec.for_prediction(d).parallel.dp == 2
    with pytest.raises(ValueError, match="tp=3 does not divide n_heads=4"):
        ExperimentSpec.for_prediction({"parallel": {"strategy": "zero1", "world_size": 3, "tp": 3}})


def test_plan_ranks_fitting_layouts_fastest_first():
    hw = get_hardware("a100-80gb-sxm")
    res = plan(MODEL, gpus=16, gpus_per_node=8, hw=hw, global_batch=32, top=5, memory_bytes=4e9)
    steps = [c["step_time"]["step_s"] for c in res.configs]
    assert res.searched > 1000 and res.feasible >= len(res.configs) == 5 and steps == sorted(steps)
    assert all(c["fits_exact"] and c["mem_bytes_max"] < c["need_bytes"] <= 4e9 for c in res.configs)
    # issue 20 item 12: one unit on the Plan page (GiB), the device named as sold (decimal GB)
    budget_note = next(n for n in res.notes if n.startswith("layouts priced on "))
    assert budget_note == "layouts priced on cuda ranks, each fitting 3.7 GiB (a 4 GB device) with its allowance"


def test_plan_cli_json_contract(capsys):
    argv = ["plan", "--vocab", "1000", "--hidden", "128", "--layers", "8", "--heads", "8", "--gpus", "8",
            "--gpus-per-node", "8", "--hardware", "h100-sxm", "--global-batch", "16", "--seq", "64", "--top", "3",
            "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert {"searched", "feasible", "seconds", "configs"} <= set(d) and len(d["configs"]) == 3
    c = d["configs"][0]
    assert tuple(c["step_time"]) == STEP_KEYS and c["mem_bytes_max"] > 0
    assert ExperimentSpec.for_prediction(c["spec"]).parallel.world_size == 8
    assert main(argv[:-1] + ["--preset", "llama"]) == 2  # not a preset: refused before searching, naming the known ones
    assert "unknown preset 'llama'" in (err := capsys.readouterr().err) and "llama-2-70b" in err


def test_plan_reserve_and_fragmentation_flags_replace_the_allowance(capsys):
    """--reserve-gb replaces the CUDA context + NCCL buffers with one fixed reserve per GPU; --fragmentation replaces
    the allocator slack's fraction; every printed layout's need is its fullest moment + exactly that allowance."""
    argv = ["plan", "--vocab", "1000", "--hidden", "128", "--layers", "8", "--heads", "8", "--gpus", "8",
            "--gpus-per-node", "8", "--hardware", "h100-sxm", "--global-batch", "16", "--seq", "64", "--top", "3",
            "--json"]
    assert main(argv) == 0
    default = json.loads(capsys.readouterr().out)
    assert (default["allowance"]["cuda_context_bytes"] == 527 * 2**20
            and default["allowance"]["fragmentation_frac"] == 0.13)
    assert main(argv + ["--reserve-gb", "2", "--fragmentation", "0.25"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["allowance"] == {"cuda_context_bytes": 2_000_000_000, "nccl_bytes_per_communicator": 0,
                              "fragmentation_frac": 0.25}
    assert d["configs"]
    for c in d["configs"]:
        a = c["allowance_bytes"]
        assert a["cuda_context"] == 2e9 and a["nccl_buffers"] == 0
        assert a["fragmentation"] == pytest.approx(0.25 * c["mem_bytes_max"])
        assert c["need_bytes"] == pytest.approx(c["mem_bytes_max"] * 1.25 + 2e9)
        assert c["fullest_budget_bytes"] == pytest.approx((d["device_bytes"] - 2e9) / 1.25)
    # overrides that cannot describe a device are refused before searching (a negative slack divided by zero)
    for flags, said in ((["--reserve-gb", "200"],
                         "--reserve-gb 200 GB is not less than the 84.94 GB per GPU of h100-sxm"),
                        (["--reserve-gb", "20", "--memory-gb", "16"],
                         "not less than the 16 GB per GPU of h100-sxm (--memory-gb)"),
                        (["--reserve-gb", "-1"], "--reserve-gb must be >= 0"),
                        (["--fragmentation", "-1"], "--fragmentation must be between 0 and 1"),
                        (["--fragmentation", "1.5"], "got 1.5"),
                        (["--memory-gb", "0"], "--memory-gb must be > 0")):
        assert main(argv + flags) == 2, flags
        out, err = capsys.readouterr()
        assert said in err and not out, (flags, err)
