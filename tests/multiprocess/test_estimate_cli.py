"""`python -m backend estimate` as a program: the JSON contract, and bad specs or flags exit 2 with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backend", "estimate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_json_contract_subprocess():
    p = cli("--strategy", "zero3", "--world", "4", "--layers", "2", "--global-batch", "8", "--micro-batch", "1", "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)  # exactly one JSON object on stdout
    assert [r["rank"] for r in d["per_rank"]] == [0, 1, 2, 3]
    for row in d["per_rank"]:
        assert {"params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "total_bytes"} <= set(row)
    assert set(d["comm_bytes_per_step"]) == {"all_gather", "reduce_scatter"}
    assert d["bubble_fraction"] is None and d["flops_per_step"] > 0


def test_invalid_spec_exits_2_with_arithmetic():
    p = cli("--dp", "2", "--tp", "3", "--world", "4")
    assert p.returncode == 2 and p.stdout == ""
    assert "dp(2) * tp(3) * pp(1) = 6 != world_size(4)" in p.stderr


def test_unknown_choice_is_usage_error():
    p = cli("--strategy", "zero9")
    assert p.returncode == 2 and "invalid choice" in p.stderr
