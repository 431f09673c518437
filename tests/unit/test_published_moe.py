"""Issue 35: the published MoE rows (backend/analytic/steptime/published_gpu.json, group "H100 MoE") are the quoted
configurations, predicted through their spec alone (benchmarks/published_gpu.py reports their errors per stack)."""

from __future__ import annotations

import pytest

from backend.analytic.steptime.published_gpu import published_rows, raw_rows
from backend.spec import ExperimentSpec

MOE = [r for r in raw_rows() if r["group"] == "H100 MoE"]


def _cells(quote: str) -> list[str]:
    return [c.strip() for c in quote.strip().strip("|").split("|")]


def test_there_are_moe_rows_and_each_is_a_moe_model():
    rows = {r.id: r for r in published_rows()}
    assert len(MOE) >= 4
    for raw in MOE:
        spec = ExperimentSpec.for_prediction(rows[raw["id"]].spec)
        assert spec.model.n_experts > 1 and spec.parallel.ep > 1 and rows[raw["id"]].stack == "megatron", raw["id"]


@pytest.mark.parametrize("row", [r for r in MOE if r["id"].startswith("bridge")], ids=lambda r: r["id"])
def test_megatron_bridge_moe_rows_are_the_quoted_configs(row):
    """The quoted table row, read through the row's own column header (the archive's tables differ by container)."""
    c = dict(zip(_cells(row["columns"]), _cells(row["quote"]), strict=False))
    par, train = row["spec"]["parallel"], row["spec"]["train"]
    assert int(c["#-GPUs"]) == par["world_size"] == row["published"]["gpus"]
    assert (c.get("System", "DGX-H100") == "DGX-H100"
            and (c.get("Precision") == "BF16") == (train["precision"] == "bf16-mixed"))
    assert (int(c["GBS"]), int(c["MBS"]), int(c["Sequence Length"])) == (train["global_batch"], train["micro_batch"],
                                                                         row["spec"]["model"]["seq_len"])
    assert (int(c["TP"]), int(c["PP"]), int(c["CP"]), int(c["EP"])) == (par["tp"], par["pp"], par["cp"], par["ep"])
    assert (c["VP"] == "n/a") == ("virtual_stages" not in par) and c["FSDP"] == "0" and par["strategy"] == "zero1"
    assert c["VP"] == "n/a" or int(c["VP"]) == par["virtual_stages"]
    assert float(c["Tokens / sec / GPU"]) == row["published"]["value"]
    assert row["published"]["tokens_per_step"] == train["global_batch"] * row["spec"]["model"]["seq_len"]


@pytest.mark.parametrize("row", [r for r in MOE if r["id"].startswith("dgxc")], ids=lambda r: r["id"])
def test_grok1_rows_are_the_512_gpu_column(row):
    """README_314b.md step-time rows: columns 8 ... 2048 GPUs; the 512 column (the 7th) is the row's step."""
    c = _cells(row["quote"])
    assert c[0] == "Training step time (seconds per step)" and float(c[7]) == row["published"]["value"]
    assert row["spec"]["parallel"]["world_size"] == 512 and row["spec"]["parallel"]["etp"] == 4
