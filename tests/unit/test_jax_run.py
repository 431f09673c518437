"""JAX/XLA GSPMD on 4 virtual CPU devices: dp, fsdp, tp and dp x tp, each with loss parity ≤ 1e-4 vs the torch
reference (same seeded weights by name, same data), XLA's argument bytes per device equal to the analytic
params + optimizer state + data (backend/analytic/frameworks/gspmd.py), and the HLO's collectives listed.
Also the pure parts: the layout arithmetic, HLO parsing, and what jax refuses before launch. The runs are farm jobs
(one process for every JAX run: N virtual devices); a failing run's error file comes from the program itself."""

from __future__ import annotations

import pytest

from backend.analytic.frameworks.gspmd import layout, predicted_bytes
from backend.frameworks.jax.hlo import collectives, group_size
from backend.spec import ExperimentSpec, validate_spec
from tests.helpers.farm import engine_job, params, uses
from tests.helpers.launch import ROOT

MODES = {"dp": ("ddp", 1), "fsdp": ("zero3", 1), "tp": ("tp", 4), "dp x tp": ("tp", 2)}
HLO = """
ENTRY %main.1 (p0: f32[8,4]) -> f32[8,4] {
  %all-gather.6 = f32[128]{0} all-gather(%param), channel_id=12, replica_groups=mesh['axis_0'=4] {'axis_0'}, dimensions={0}
  %all-reduce.39 = (f32[128]{0}, /*index=1*/f32[16,8]{1,0}) all-reduce(%a, %b), replica_groups={{0,1},{2,3}}, to_apply=%add
  %rs = f32[32]{0} reduce-scatter(f32[128]{0} %x), replica_groups=[1,4]<=[4], dimensions={0}
}
"""  # noqa: E501 (XLA's HLO text, as jax dumps it: one instruction a line)


def _spec(mode: str, world: int = 4, **extra) -> ExperimentSpec:
    strategy, tp = MODES[mode]
    return ExperimentSpec.model_validate({
        "framework": "jax", "model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 16},
        "train": {"global_batch": 8, "micro_batch": 1, "steps": 2, "warmup_steps": 1},
        "parallel": {"strategy": strategy, "world_size": world, "tp": tp}, "runtime": {"timeout_s": 400}, **extra})


def test_hlo_collectives_counted_with_bytes_and_groups() -> None:
    got = collectives(HLO)
    assert got["all_gather"] == {"calls": 1, "bytes": 512, "group_sizes": [4], "in_loop": 0}
    assert got["all_reduce"]["bytes"] == 4 * (128 + 128) and got["all_reduce"]["group_sizes"] == [2]
    assert got["reduce_scatter"]["bytes"] == 4 * 32 * 4  # payload = the input: output x group size
    assert group_size("replica_groups=[2,2]<=[4]") == 2


def test_layouts() -> None:
    assert all(v == (None, None) for v in layout(_spec("dp")).values())
    fsdp = layout(_spec("fsdp"))
    assert fsdp["layers.0.attn.q.weight"] == (0, "dp") and fsdp["layers.0.ln1.weight"] == (0, "dp")
    tp = layout(_spec("tp"))
    assert tp["layers.0.attn.q.weight"] == (0, "tp") and tp["layers.0.attn.o.weight"] == (1, "tp")
    assert tp["layers.0.attn.o.bias"] == (None, None) and tp["lm_head.weight"] == (0, "tp")
    pb = predicted_bytes(_spec("fsdp"))
    assert pb["optimizer_bytes"] == 2 * pb["params_bytes"]  # Adam m and v, sharded like the parameters


@pytest.mark.parametrize("data, needle", [
    ({"parallel": {"strategy": "zero2", "world_size": 4}}, "ZeRO-1/2 have no layout of their own"),
    ({"parallel": {"strategy": "pp", "world_size": 4, "pp": 2}}, "pipeline and expert parallelism"),
    ({"parallel": {"strategy": "ddp", "world_size": 4, "cp": 2}, "model": {"attention": "flash", "seq_len": 16}},
     "(and context parallelism) are not written in JAX here (pp=1, ep=1, cp=2)"),
    ({"parallel": {"strategy": "ddp", "world_size": 4}, "train": {"precision": "bf16-mixed"}}, "fp32 only"),
    ({"parallel": {"strategy": "ddp", "world_size": 4}, "runtime": {"device": "cuda"}}, "virtual CPU devices"),
])
def test_refused_before_launch(data, needle) -> None:
    spec, problems = validate_spec({"framework": "jax", **data})
    assert spec is None and any(needle in p for p in problems), problems


@pytest.mark.parametrize("strategy, degree", [("pp", "pp"), ("tp", None), ("ep", "ep")])
def test_a_refused_strategy_is_not_explained_by_zero_1_2(strategy, degree) -> None:
    """Only ZeRO-1/2 are refused because GSPMD shards parameters and optimizer state together; pp or ep are refused
    for their own reason, and the ZeRO sentence would send the user the wrong way."""
    parallel = {"strategy": strategy, "world_size": 4, **({degree: 2} if degree else {})}
    model = {"n_experts": 2} if strategy == "ep" else {}
    _, problems = validate_spec({"framework": "jax", "parallel": parallel, "model": model})
    if strategy == "tp":  # tp is a JAX layout: no strategy refusal at all
        assert not any("runs dp (ddp), fsdp" in p for p in problems), problems
        return
    assert any(f"got {strategy}" in p for p in problems) and not any("ZeRO-1/2" in p for p in problems), problems


@pytest.mark.parametrize("family", [{"norm": "rmsnorm"}, {"mlp": "swiglu"}, {"positions": "rope"}, {"bias": "none"},
                                    {"tie_embeddings": True}, {"norm_eps": 1e-6}])
def test_a_family_the_jax_gpt_does_not_write_is_refused_before_launch(family) -> None:
    """The JAX twin (frameworks/jax/gpt.py) is the GPT family only; a Llama-style spec used to pass validation and
    fail inside the rank (KeyError: 'layers.0.ln1.bias' after the weights transfer by name)."""
    spec, problems = validate_spec({"framework": "jax", "model": {"n_heads": 4, **family},
                                    "parallel": {"strategy": "ddp", "world_size": 2}})
    assert spec is None and any("GPT family only" in p and next(iter(family)) in p for p in problems), problems


# ---- end to end (the farm: one process, virtual CPU devices) -----------------------------------------------------

RUNS = {mode: engine_job(_spec(mode)) for mode in MODES}


def _run(farm, mode: str):
    pytest.importorskip("jax")
    res = farm.result(RUNS[mode])["result"]
    assert res.status == "ok", (res.error, res.traceback, (res.log_tail or "")[-2000:])
    assert res.loss_max_abs_diff is not None and res.loss_max_abs_diff <= 1e-4
    facts = res.framework_facts
    assert facts["memory_analysis"]["argument_size_in_bytes"] == facts["argument_bytes_predicted"]
    assert len(res.per_rank) == 4
    for rr in res.per_rank:
        assert rr.measured.params_bytes == rr.predicted.params_bytes
        assert rr.measured.optimizer_bytes == rr.predicted.optimizer_bytes
    assert any("ONE process" in n for n in res.notes)
    return res, facts["collectives"]


@uses(RUNS["fsdp"])
def test_fsdp_end_to_end(farm) -> None:
    """The default suite's one JAX run: fsdp's all-gathers and XLA's all-reduce where torch reduce-scatters."""
    res, coll = _run(farm, "fsdp")
    assert coll["all_gather"]["calls"] > 0 and "reduce_scatter" not in coll
    assert coll["all_reduce"]["group_sizes"] == [4]
    assert any("XLA CPU emits no reduce-scatter" in n for n in res.notes)


@pytest.mark.slow
@pytest.mark.parametrize("mode", params({m: RUNS[m] for m in ("dp", "tp", "dp x tp")}))
def test_modes_end_to_end(farm, mode: str) -> None:
    res, coll = _run(farm, mode)
    assert coll["all_reduce"]["calls"] >= 1 and coll["all_reduce"]["bytes"] > 0
    if mode == "dp":
        assert "all_gather" not in coll


@pytest.mark.multiprocess  # the rank program's own process: its entry writes the error file
def test_a_failing_jax_run_leaves_the_engines_error_file(tmp_path) -> None:
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "backend.frameworks.jax.run", "--spec", str(tmp_path / "missing.json"),
                        "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    err = json.loads((tmp_path / "rank-0.error.json").read_text())
    assert r.returncode == 1 and err["rank"] == 0 and err["error"].startswith("FileNotFoundError") and err["traceback"]
