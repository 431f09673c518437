"""Narayanan et al. 2021 (PTD-P) Table 1: published vs predicted achieved TFLOP/s per GPU, A100 80GB profile.

  .venv/bin/python benchmarks/ptdp_table1.py

No per-row tuning: one hardware profile (backend/analytic/steptime/hardware.json "a100-80gb-sxm"), eager
attention (2021 Megatron: unfused QKᵀ / softmax / dropout), fused element-wise kernels (the paper's Sec 4.2), b = 1,
1F1B (backend/analytic/steptime/published.py).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.analytic.steptime.hardware import get_hardware  # noqa: E402
from backend.analytic.steptime.model import step_time  # noqa: E402
from backend.analytic.steptime.published import PTDP_TABLE1, ptdp_predicted_tflops, ptdp_spec_dict  # noqa: E402
from backend.spec import ExperimentSpec  # noqa: E402


def rows() -> list[dict]:
    hw = get_hardware("a100-80gb-sxm")
    out = []
    for row in PTDP_TABLE1:
        spec = ExperimentSpec.model_validate(ptdp_spec_dict(row))
        st = step_time(spec, hw, attention="eager", implementation="fused")
        pred = ptdp_predicted_tflops(row, st.summary["step_s"])
        out.append({"params_b": row[0], "t": row[4], "p": row[5], "gpus": row[6], "batch": row[7], "published": row[8],
                    "predicted": pred, "error_pct": (pred - row[8]) / row[8] * 100, **st.summary})
    return out


def main() -> None:
    t0 = time.perf_counter()
    data = rows()
    print("Narayanan et al. 2021 Table 1 (A100 80GB, 1F1B, b=1): achieved TFLOP/s per GPU")
    print(f"{'params':>8} {'t':>2} {'p':>3} {'GPUs':>5} {'batch':>5} {'published':>9} {'predicted':>9} {'error':>7}"
          f" {'step_s':>7} {'compute':>7} {'comm':>6} {'bubble':>6}")
    for r in data:
        print(f"{r['params_b']:>7}B {r['t']:>2} {r['p']:>3} {r['gpus']:>5} {r['batch']:>5} {r['published']:>9} "
              f"{r['predicted']:>9.1f} {r['error_pct']:>+6.1f}% {r['step_s']:>7.2f} {r['compute_s']:>7.2f} "
              f"{r['exposed_comm_s']:>6.2f} {r['bubble_s']:>6.2f}")
    worst = max(abs(r["error_pct"]) for r in data)
    print(f"worst |error| {worst:.1f}% (bound 10%); {time.perf_counter() - t0:.2f} s for 10 predictions")


if __name__ == "__main__":
    main()
