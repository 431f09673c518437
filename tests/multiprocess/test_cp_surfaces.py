"""Context parallelism through the CLI in a subprocess: estimate and plan JSON carry cp, a bad cp degree is refused
with its arithmetic. The in-process surfaces: tests/unit/test_cp_surfaces.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cli_estimate_and_plan_json_carry_cp():
    run = lambda *args: subprocess.run([sys.executable, "-m", "backend", *args], capture_output=True, text=True,  # noqa: E731
                                       cwd=ROOT, timeout=300)
    est = run("estimate", "--world", "4", "--cp", "2", "--cp-rotate", "alltoall", "--no-cp-load-balance",
              "--attention", "flash", "--seq", "32", "--json")
    assert est.returncode == 0, est.stderr
    out = json.loads(est.stdout)
    assert out["per_rank"][1]["coords"] == {"pp": 0, "dp": 0, "cp": 1, "tp": 0, "ep": 0}
    assert "all_to_all" in out["comm_bytes_per_step"]
    bad = run("estimate", "--world", "4", "--cp", "3", "--attention", "flash", "--json")
    assert bad.returncode == 2 and "is not divisible by tp(1) * pp(1) * cp(3) = 3" in bad.stderr + bad.stdout
    plan = run("plan", "--preset", "llama-3-8b", "--gpus", "64", "--global-batch", "16", "--seq", "65536",
               "--hardware", "h100-sxm",
               "--attention", "flash", "--top", "3", "--json")
    assert plan.returncode == 0, plan.stderr
    configs = json.loads(plan.stdout)["configs"]
    assert configs and all("cp" in c["spec"]["parallel"] for c in configs)
    assert any(c["spec"]["parallel"]["cp"] > 1 for c in configs)  # 64k context: the planner picks cp
