"""JAX / XLA GSPMD runs through the launcher (one process, virtual CPU devices): fsdp and every mode end to end, and a failing run's error file."""

from __future__ import annotations

import pytest

from backend.frameworks.jax.hlo import collectives
from backend.spec import ExperimentSpec

MODES = {"dp": ("ddp", 1), "fsdp": ("zero3", 1), "tp": ("tp", 4), "dp x tp": ("tp", 2)}


def _spec(mode: str, world: int = 4, **extra) -> ExperimentSpec:
    strategy, tp = MODES[mode]
    return ExperimentSpec.model_validate({
        "framework": "jax", "model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 16},
        "train": {"global_batch": 8, "micro_batch": 1, "steps": 2, "warmup_steps": 1},
        "parallel": {"strategy": strategy, "world_size": world, "tp": tp}, "runtime": {"timeout_s": 400}, **extra})


def _run(mode: str, tmp_path):
    pytest.importorskip("jax")
    from backend.launch.launcher import run_experiment

    res = run_experiment(_spec(mode), workdir=tmp_path / "run")
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


def test_fsdp_end_to_end(tmp_path) -> None:
    """The default suite's one JAX run: fsdp's all-gathers and XLA's all-reduce where torch reduce-scatters."""
    res, coll = _run("fsdp", tmp_path)
    assert coll["all_gather"]["calls"] > 0 and "reduce_scatter" not in coll
    assert coll["all_reduce"]["group_sizes"] == [4]
    assert any("XLA CPU emits no reduce-scatter" in n for n in res.notes)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dp", "tp", "dp x tp"])
def test_modes_end_to_end(tmp_path, mode: str) -> None:
    res, coll = _run(mode, tmp_path)
    assert coll["all_reduce"]["calls"] >= 1 and coll["all_reduce"]["bytes"] > 0
    if mode == "dp":
        assert "all_gather" not in coll


def test_a_failing_jax_run_leaves_the_engines_error_file(tmp_path) -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    r = subprocess.run([sys.executable, "-m", "backend.frameworks.jax.run", "--spec", str(tmp_path / "missing.json"),
                        "--out", str(tmp_path)], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2],
                       timeout=120)
    err = json.loads((tmp_path / "rank-0.error.json").read_text())
    assert r.returncode == 1 and err["rank"] == 0 and err["error"].startswith("FileNotFoundError") and err["traceback"]
