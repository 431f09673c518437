"""Compare's "Frameworks side by side" for an imported run (its log gives allocator peaks, no categories): the
categories and comm bytes read "not in the log", as in the side-by-side table above it, never 0 B, and the memory
bar chart draws no zero bars for it."""

from __future__ import annotations

import json
from pathlib import Path

from backend.cli import main
from backend.result import RunResult
from dashboard import framework_view as fv

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "imports"


def _imported(tmp_path, monkeypatch, capsys) -> RunResult:
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'store.db'}")
    assert main(["import-run", "--config", str(FIX / "deepspeed_zero3.json"), "--model-config",
                 str(FIX / "llama2_7b_config.json"), "--log", str(FIX / "deepspeed_zero3.log"), "--json"]) == 0
    res = RunResult.model_validate(json.loads(capsys.readouterr().out)["result"])
    assert res.imported is not None and not res.memory_measured
    return res


def test_imported_run_categories_are_unknown_not_zero(tmp_path, monkeypatch, capsys) -> None:
    res = _imported(tmp_path, monkeypatch, capsys)
    col = fv.three_frameworks_frame([(7, res)])["#7 deepspeed"]
    for row in ("parameters", "gradients", "optimizer state", "activations", "comm bytes / step / rank"):
        assert col[row] == "– (not in the log)", (row, col[row])
    assert col["step time (median)"] != "—"
    fig = fv.three_frameworks_fig([(7, res)])
    assert all(len(bar.x) == 0 for bar in fig.data)


def test_a_jax_runs_predicted_total_says_it_has_no_activations() -> None:
    """A JAX run is predicted without activations (XLA's temp buffer) but measured with them: Compare's predicted
    cell says so instead of showing a total 6x below the measured one as if it were the same sum."""
    from backend.spec import ExperimentSpec
    from dashboard.compare_view import compare_frame
    from tests.helpers.store_helpers import TINY, fake_result

    frames = {}
    for fw in ("torch", "jax"):
        s = ExperimentSpec.model_validate({**TINY, "framework": fw})
        frames[fw] = compare_frame([{"id": 1, "spec": s, "result": fake_result(s), "status": "ok"}]).iloc[:, 0]
    assert frames["jax"]["memory, fullest rank: predicted"].endswith("+ activations (not predicted for XLA)")
    assert "activations" not in frames["torch"]["memory, fullest rank: predicted"]
