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


@pytest.mark.slow
def test_the_gloo_ranks_never_run_the_callers_main_script(tmp_path, monkeypatch):
    """The ranks are `python -m` processes of their own: multiprocessing's spawn re-ran the caller's `__main__`
    script in each child (in a test worker that had run a Streamlit AppTest, app.py: it opened the store, failed on a
    locked database, and the probe waited 300 s for ranks that were gone)."""
    import sys
    import types

    hostile = tmp_path / "page.py"
    hostile.write_text("raise SystemExit('the caller main script ran in a probe rank')\n")
    main = types.ModuleType("__main__")
    main.__file__ = str(hostile)
    monkeypatch.setitem(sys.modules, "__main__", main)
    alpha, beta, eff, dtensor_s, raw = hw_probe.gloo_alpha_beta()
    assert beta > 1e6 and 0 < alpha < 0.1 and dtensor_s > 0
    assert [len(raw[c]) for c in hw_probe.COLLECTIVES] == [len(hw_probe.AR_BYTES)] * 3


def test_a_failing_rank_ends_the_probe_at_once_with_its_error(tmp_path):
    """The other rank (waiting at the rendezvous) is killed; the error names the rank, its exit code and stderr."""
    import subprocess
    import sys
    import time

    (tmp_path / "rank0.err").write_text("")
    (tmp_path / "rank1.err").write_text("")
    with (tmp_path / "rank0.err").open("w") as err:
        failing = subprocess.Popen([sys.executable, "-c", "import sys; print('rendezvous refused', file=sys.stderr); "
                                    "sys.exit(3)"], stderr=err)
        waiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 0 exited 3: rendezvous refused"):
            hw_probe.wait_ranks([failing, waiting], tmp_path)
    assert time.monotonic() - t0 < 30 and waiting.returncode is not None
