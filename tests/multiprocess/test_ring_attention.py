"""ShardLab's CPU ring attention (backend/strategies/ring_attention.py) equals one process's causal SDPA on the whole
sequence, forward and backward, for both K/V rotations and both chunk layouts, at world 4 on gloo."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BOUND = {"float32": 1e-5, "bfloat16": 3e-2}  # bf16: 8-bit mantissa; blocks merged in fp32 in both orders


@pytest.mark.slow
def test_ring_attention_matches_sdpa_on_every_variant(tmp_path):
    out = tmp_path / "ring.json"
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                           "-m", "tests.helpers.cp_ring_check", str(out)], capture_output=True, text=True, timeout=300,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 8
    for row in rows:
        bound = BOUND[row["dtype"]]
        assert max(row[k] for k in ("out", "dq", "dk", "dv")) < bound, row
