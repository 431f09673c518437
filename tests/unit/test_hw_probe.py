"""The CPU micro-benchmark writes a profile that the step-time model loads as "cpu"."""

from __future__ import annotations

import pytest

from backend.analytic.steptime.hardware import get_hardware
from backend.bench import hw_probe


@pytest.mark.slow
def test_probe_writes_a_loadable_cpu_profile(tmp_path, monkeypatch):
    out = tmp_path / "cpu.json"
    monkeypatch.setenv("SHARDLAB_CPU_PROFILE", str(out))
    assert hw_probe.main([]) == 0
    hw = get_hardware("cpu")
    assert hw.kind == "cpu" and hw.cores >= 1
    assert 1e8 < hw.peak("fp32") < 1e13  # one core: 0.1 GFLOP/s .. 10 TFLOP/s
    curve = dict(map(tuple, __import__("json").loads(out.read_text())["measured"]["gemm_flops_by_size"]))
    assert len(curve) == len(hw_probe.GEMM_SIZES)
    assert hw.intra_bytes_per_s > 1e6 and 0 < hw.tune.intra_latency_s < 0.1
