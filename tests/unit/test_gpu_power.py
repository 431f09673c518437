"""The GPU check's power phase (backend/gpucheck/power.py, power_probe.py): nvidia-smi's lines read, the draw of a
workload's timed window averaged, the rate its calls achieved, and what the phase records where there is no GPU."""

from __future__ import annotations

import stat
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from backend.gpucheck.kit_context import KitContext
from backend.gpucheck.power import line, power_phase
from backend.gpucheck.power_probe import SETTLE_S, Sampler, Samples, Workload, measure, parse_smi_line
from backend.gpucheck.summary import render

pytestmark = pytest.mark.unit


def test_an_smi_line_is_read_and_anything_else_is_not():
    assert parse_smi_line("612.34, 1755, 700.00, 61\n") == {"power.draw": 612.34, "clocks.sm": 1755.0,
                                                           "power.limit": 700.0, "temperature.gpu": 61.0}
    assert parse_smi_line("[N/A], 1755, 700.00, 61") is None
    assert parse_smi_line("power.draw [W], clocks.current.sm [MHz], power.limit [W], temperature.gpu") is None
    assert parse_smi_line("612.34, 1755") is None and parse_smi_line("") is None


def _row(power: float, mhz: float) -> dict[str, float]:
    return {"power.draw": power, "clocks.sm": mhz, "power.limit": 700.0, "temperature.gpu": 50.0 + power / 100}


def test_the_window_leaves_the_ramp_out_and_averages_the_rest():
    s = Samples([(10.0, _row(100, 1000)), (10.0 + SETTLE_S / 2, _row(300, 1500)),  # the ramp: left out
                 (10.0 + SETTLE_S, _row(600, 1800)), (11.0, _row(700, 1700)), (12.5, _row(900, 2000))])
    w = s.window(10.0, 12.0)
    assert w["samples"] == 2 and w["power_w"] == pytest.approx(650) and w["sm_mhz"] == pytest.approx(1750)
    assert w["power_limit_w"] == 700 and w["temperature_c"] == pytest.approx(57)
    assert s.window(20.0, 30.0) == {"samples": 0, "power_w": None, "sm_mhz": None}


def test_the_sampler_reads_a_looping_smi_until_stopped(tmp_path: Path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'power.draw [W], clocks.current.sm [MHz], power.limit [W], temperature.gpu'\n"
                    "while true; do echo '455.10, 1980, 700.00, 48'; sleep 0.02; done\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    sampler = Sampler(str(fake), interval_ms=20)
    t0 = time.monotonic()
    time.sleep(SETTLE_S + 0.3)
    sampler.stop()
    w = sampler.samples.window(t0, time.monotonic())
    assert w["samples"] >= 3 and w["power_w"] == pytest.approx(455.1) and w["sm_mhz"] == 1980
    assert sampler.proc.returncode is not None


def test_a_workload_reports_its_calls_rate_and_the_draw_meanwhile():
    calls = []
    fake_torch = SimpleNamespace(cuda=SimpleNamespace(synchronize=lambda: None))
    samples = Samples()

    def call() -> None:
        calls.append(time.monotonic())
        samples.rows.append((calls[-1], _row(500, 1900)))
        time.sleep(0.01)

    row = measure(fake_torch, SimpleNamespace(samples=samples), Workload("w", call, 1e9, "flop/s"), 1.0)
    timed = row["calls"]
    assert row["status"] == "ok" and timed % 4 == 0 and 0 < timed < len(calls)  # the warm-up's calls are not timed
    assert row["achieved_per_s"] == pytest.approx(timed * 1e9 / row["seconds"])
    assert row["power_w"] == 500 and row["sm_mhz"] == 1900 and row["samples"] > 0


def test_a_workload_that_raises_is_a_failed_row():
    def call() -> None:
        raise RuntimeError("No available kernel")

    row = measure(SimpleNamespace(cuda=SimpleNamespace(synchronize=lambda: None)), SimpleNamespace(samples=Samples()),
                  Workload("attention_cudnn", call, 1.0, "flop/s"), 0.1)
    assert row == {"name": "attention_cudnn", "status": "failed", "error": "RuntimeError: No available kernel"}


def test_the_phase_says_why_it_measures_nothing_on_cpu_ranks(tmp_path: Path):
    ctx = KitContext(device="cpu", nproc=1, out=tmp_path, work=tmp_path, check_id="t")
    row = power_phase(ctx, 30.0)
    assert row["status"] == "skipped" and "CUDA" in line(row)


def test_a_measured_report_reads_as_one_line_in_the_summary():
    power = {"status": "ok", "idle": {"power_w": 88.0}, "kernels": [
        {"name": "gemm_bf16", "status": "ok", "unit": "flop/s", "achieved_per_s": 6.83e14, "power_w": 699.0,
         "sm_mhz": 1755.0},
        {"name": "copy", "status": "ok", "unit": "bytes/s", "achieved_per_s": 4.1e12, "power_w": 420.0,
         "sm_mhz": 1980.0},
        {"name": "attention_cudnn", "status": "failed", "error": "x"}]}
    text = line(power)
    assert text == ("idle 88 W; gemm_bf16 699 W at 1755 MHz, 683.0 TFLOP/s; copy 420 W at 1980 MHz, 4.1 TB/s; "
                    "attention_cudnn failed")
    assert text in render({"power": power})



def test_a_child_that_fails_or_prints_no_json_is_a_failed_row_with_the_reason():
    from backend.gpucheck.phases import child_row

    assert child_row(0, "warming up\n{\"status\": \"ok\"}\n", "") == {"status": "ok"}
    assert child_row(None, "", "killed")["error"] == "timed out: killed"
    assert child_row(3, "", "CUDA error")["error"] == "exited 3: CUDA error"
    assert child_row(0, "no json", "")["error"].startswith("unreadable output")
