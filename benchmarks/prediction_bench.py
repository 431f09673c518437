"""New-experiment prediction refresh: analytic estimate + figure/table build must stay < 100 ms.

Run: .venv/bin/python benchmarks/prediction_bench.py
Prints the median and worst time per spec (estimate, then figure) and the ratio to the 100 ms target.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboard import predict_view as pv  # noqa: E402
from dashboard import spec_form as sf  # noqa: E402

TARGET_S = 0.100
LLAMA70B = sf.PRESETS[sf.preset_label("llama-2-70b")]  # published shape: 80 layers, d 8192, GQA 8
CASES = {
    "tiny ddp, world 2": dict(strategy="ddp", world_size=2),
    "tiny zero3, world 8": dict(strategy="zero3", world_size=8, global_batch=8, micro_batch=1),
    "Llama-2-70B fsdp, world 8": dict(LLAMA70B, strategy="fsdp", world_size=8, global_batch=8, micro_batch=1),
    "Llama-2-70B zero1, world 64": dict(LLAMA70B, strategy="zero1", world_size=64, global_batch=64, micro_batch=1),
    "Llama-2-70B tp8 x pp8 x dp4 (256)": dict(LLAMA70B, strategy="zero2", world_size=256, tp=8, pp=8, global_batch=64,
                                              micro_batch=1, pp_schedule="1f1b"),
}


def _refresh(values: dict) -> tuple[float, float]:
    t0 = time.perf_counter()
    spec, problems = sf.form_to_spec(values)
    assert not problems, problems
    est, rows = pv.predict(spec)
    t1 = time.perf_counter()
    pv.per_rank_memory_fig(rows, device_mem_bytes=80e9).to_plotly_json()
    pv.comm_frame(est.per_rank)
    pv.fit_check(rows, 80e9)
    pv.headline(est)
    return t1 - t0, time.perf_counter() - t1


def main(repeats: int = 15) -> int:
    worst = 0.0
    print(f"{'case':40s} {'estimate ms':>12s} {'figure ms':>10s} {'total ms (median / max)':>26s}")
    for name, overrides in CASES.items():
        v = dict(sf.default_form(), **overrides)
        _refresh(v)  # warm imports
        runs = [_refresh(v) for _ in range(repeats)]
        totals = [a + b for a, b in runs]
        med = statistics.median(totals)
        worst = max(worst, med)
        print(f"{name:40s} {statistics.median(a for a, _ in runs) * 1e3:12.1f} "
              f"{statistics.median(b for _, b in runs) * 1e3:10.1f} {med * 1e3:14.1f} / {max(totals) * 1e3:.1f}")
    print(f"slowest median refresh {worst * 1e3:.1f} ms vs target {TARGET_S * 1e3:.0f} ms: ratio "
          f"{worst / TARGET_S:.2f} ({'PASS' if worst < TARGET_S else 'FAIL'})")
    return 0 if worst < TARGET_S else 1


if __name__ == "__main__":
    sys.exit(main())
