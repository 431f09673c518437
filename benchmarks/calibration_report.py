"""Calibration evidence on this machine: fit on stored world-2 runs, leave-one-out error, then predict world 3-4 runs.

  SHARDLAB_DB_URL=sqlite:////tmp/i13.db .venv/bin/python benchmarks/calibration_report.py
      --fit-tag cal-w2 --test-tag cal-w34

The runs are produced with `python -m backend submit ... --tag cal-w2` + `python -m backend worker --drain`
(small CPU models, several strategies). Prints the fitted parameters, each fit run's leave-one-out
prediction, the LOO MAPE (issue 13 target <= 15%), and for each test run: measured, predicted, error,
interval and whether the measurement fell inside it, plus the extrapolation flags.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.analytic.steptime.hardware import get_hardware  # noqa: E402
from backend.analytic.steptime.model import step_time  # noqa: E402
from backend.calibration import fit as F  # noqa: E402
from backend.calibration import records  # noqa: E402
from db.session import open_db  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit-tag", default="cal-w2")
    ap.add_argument("--test-tag", default="cal-w34")
    ap.add_argument("--hardware", default="cpu")
    ap.add_argument("--db")
    args = ap.parse_args()
    engine = open_db(args.db)
    hw = get_hardware(args.hardware)
    fit_samples, problems = records.samples(engine, tag=args.fit_tag)
    test_samples, _ = records.samples(engine, tag=args.test_tag)
    print(f"fit on {len(fit_samples)} runs tagged {args.fit_tag!r} ({hw.key}); {'; '.join(problems) or 'all usable'}")
    # the evidence: each left-out run is predicted by a fit that never saw it
    result = F.fit(hw, fit_samples, cold_loo=True)
    cal_id = records.save(engine, hw.key, result, [s.run_id for s in fit_samples])
    print(f"calibration id {cal_id}; parameters:")
    for k, v in result.params.items():
        print(f"  {k:<22} {getattr(hw.tune, k):>11.4g} -> {v:.4g}")
    print(f"{'run':>4} {'strategy':<8} {'world':>5} {'measured s':>10} {'LOO pred s':>10} {'error':>7}")
    for s, r in zip(fit_samples, result.loo, strict=False):
        print(f"{s.run_id:>4} {str(s.spec.parallel.strategy):<8} {s.spec.parallel.world_size:>5} "
              f"{r['measured_s']:>10.3f} {r['predicted_s']:>10.3f} {r['error_pct']:>+6.1f}%")
    print(f"leave-one-out MAPE {result.loo_mape:.1f}% (target <= 15%); interval "
          f"{result.band[0]:+.0%}..{result.band[1]:+.0%}")
    if not test_samples:
        print(f"no runs tagged {args.test_tag!r} to predict")
        return
    hwc = F.apply(hw, result.params)
    inside, errs = 0, []
    print(f"\npredicted from calibration {cal_id}: runs tagged {args.test_tag!r}")
    print(f"{'run':>4} {'strategy':<8} {'world':>5} {'measured s':>10} {'predicted s':>11} {'error':>7} "
          f"{'interval':>17} in  extrapolation")
    for s in test_samples:
        st = step_time(s.spec, hwc, band=result.band)
        pred, lo, hi = st.summary["step_s"], st.summary["low_s"], st.summary["high_s"]
        err = (pred - s.step_s) / s.step_s * 100
        ok = lo <= s.step_s <= hi
        inside += ok
        errs.append(abs(err))
        flags = "; ".join(F.extrapolation(s.spec, result.ranges, hw.gpus_per_node)) or "-"
        print(f"{s.run_id:>4} {str(s.spec.parallel.strategy):<8} {s.spec.parallel.world_size:>5} {s.step_s:>10.3f} "
              f"{pred:>11.3f} {err:>+6.1f}% [{lo:>6.3f}, {hi:>6.3f}] {'y' if ok else 'n':>2}  {flags}")
    print(f"world 3-4: MAPE {sum(errs) / len(errs):.1f}%, interval coverage {inside}/{len(test_samples)}")


if __name__ == "__main__":
    main()
