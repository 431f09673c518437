"""CLI: `estimate --hardware` adds the step_time contract; `hardware` lists profiles; bad input fails clearly."""

from __future__ import annotations

import json

from backend.analytic.steptime.model import STEP_KEYS
from backend.cli import main


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_estimate_hardware_adds_step_time_with_exact_keys(capsys):
    d = _json(capsys, ["estimate", "--strategy", "zero3", "--world", "4", "--layers", "4", "--hardware",
                       "a100-80gb-sxm", "--gpus-per-node", "2", "--json"])
    assert tuple(d["step_time"]) == STEP_KEYS
    assert d["step_time"]["low_s"] <= d["step_time"]["step_s"] <= d["step_time"]["high_s"]
    assert d["step_time_detail"]["hardware"] == "a100-80gb-sxm" and len(d["step_time_detail"]["per_rank"]) == 1
    assert "per_rank" in d and "step_time" not in _json(capsys, ["estimate", "--json"])


def test_estimate_rejects_unknown_hardware_and_lone_gpus_per_node(capsys):
    assert main(["estimate", "--hardware", "tpu-v9"]) == 2
    assert "unknown hardware 'tpu-v9'" in capsys.readouterr().err
    assert main(["estimate", "--gpus-per-node", "8"]) == 2
    assert "--gpus-per-node needs --hardware" in capsys.readouterr().err


def test_estimate_on_an_unmeasured_cpu_profile_says_how_to_measure_it(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLAB_CPU_PROFILE", str(tmp_path / "absent.json"))
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'store.db'}")
    assert main(["estimate", "--world", "2", "--hardware", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "No 'cpu' step-time profile yet" in err and "python -m backend.bench.hw_probe" in err
    assert "unknown hardware" not in err


def test_hardware_lists_profiles(capsys):
    d = _json(capsys, ["hardware", "--json"])
    assert {"a100-40gb-sxm", "a100-80gb-sxm", "h100-sxm", "h100-pcie", "h200", "b200", "mi300x"} <= set(d)
    assert d["h100-sxm"]["peak_flops"]["bf16"] == 989.4e12 and "datasheet" in d["h100-sxm"]["source"]
    assert main(["hardware"]) == 0
    assert "mi300x" in capsys.readouterr().out


def test_measured_gpu_profile_is_one_hardware_entry(capsys, monkeypatch):
    """The GPU check's probe profile (benchmarks/results/gpu/2026-11-26-h200-run1/profile.json, via SHARDLAB_HARDWARE)
    is one hardware entry: `hardware --json` lists it with its provenance and its measured operation tables, and
    `estimate --hardware` predicts with it; every shipped GPU profile says where its tables come from."""
    from pathlib import Path

    path = (Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu" / "2026-11-26-h200-run1"
            / "profile.json")
    monkeypatch.setenv("SHARDLAB_HARDWARE", str(path))
    d = _json(capsys, ["hardware", "--json"])
    measured = d["measured-nvidia-h200"]
    assert measured["provenance"]["device_name"] == "NVIDIA H200" and measured["provenance"]["tables.gemm"]
    assert measured["tables"]["gemm"]["bf16"]["rows"] == 224 and "flash" in measured["tables"]["attention"]["kernels"]
    for key in ("h100-sxm", "h200", "b200"):
        assert d[key]["tables"]["gemm"]["bf16"]["source"] and d[key]["provenance"], key
    est = _json(capsys, ["estimate", "--strategy", "zero3", "--world", "8", "--layers", "4", "--hidden", "2048",
                         "--heads", "16", "--seq", "4096", "--global-batch", "16", "--precision", "bf16-mixed",
                         "--hardware", "measured-nvidia-h200", "--json"])
    assert est["step_time_detail"]["hardware"] == "measured-nvidia-h200" and est["step_time"]["step_s"] > 0
