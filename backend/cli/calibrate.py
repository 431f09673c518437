"""`python -m backend calibrate`: fit the step-time model to stored measured runs and store the calibration.

  python -m backend calibrate --tag cal-w2 --hardware cpu --json
  python -m backend calibrate --ids 1,2,3,4,5,6,7 --hardware cpu

Fits the profile's GEMM efficiency (a scale on its GEMM table or size curve), kernel floor, link efficiency and
latency, overlap, fixed overhead, on CPU profiles the DTensor dispatch cost and all-gather / reduce-scatter
bandwidth, and a scale on each operation table the profile has (attention, element-wise, optimizer;
backend/calibration/fit.py fitted_params) to each run's
measured step time, seconds per collective and, for pipelines, per-stage forward/backward times, reports the
leave-one-out MAPE and stores the result (table `calibrations`); `estimate`/`plan --calibration ID` use it.
Prints {"id", "hardware", "params", "fit_runs", "loo_mape", "notes"} with --json.
"""

from __future__ import annotations

import argparse
import json

from backend.cli import fail


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="fit step-time parameters to stored runs", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--tag", help="use the ok runs with this tag")
    g.add_argument("--ids", help="comma-separated run ids")
    p.add_argument("--hardware", default="cpu", help="profile to calibrate (default: cpu)")
    p.add_argument("--db", metavar="URL", help="database URL (default: $SHARDLAB_DB_URL or <repo>/data/shardlab.db)")
    p.add_argument("--no-loo", action="store_true", help="skip the leave-one-out refits (no MAPE, default interval)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from backend.analytic.steptime.hardware import get_hardware
    from backend.calibration import fit as F
    from backend.calibration import store
    from db.session import open_db

    try:
        ids = [int(x) for x in args.ids.split(",") if x.strip()] if args.ids else None
    except ValueError:
        return fail(f"--ids must be comma-separated integers (got {args.ids!r})")
    try:
        hw = get_hardware(args.hardware)
    except ValueError as e:
        return fail(str(e))
    engine = open_db(args.db)
    samples, problems = store.samples(engine, tag=args.tag, ids=ids)
    if problems and ids:
        return fail("; ".join(problems))
    try:
        result = F.fit(hw, samples, loo=not args.no_loo)
    except ValueError as e:
        return fail(str(e))
    run_ids = [s.run_id for s in samples]
    cal_id = store.save(engine, hw.key, result, run_ids)
    out = {"id": cal_id, "hardware": hw.key, "params": result.params, "fit_runs": run_ids, "loo_mape": result.loo_mape,
           "notes": result.notes + problems, "interval": list(result.band), "ranges": result.ranges, "loo": result.loo}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"calibration {cal_id} for {hw.key}: {len(run_ids)} runs, leave-one-out MAPE "
          f"{'-' if result.loo_mape is None else f'{result.loo_mape:.1f}%'}, interval {result.band[0]:+.0%}..{result.band[1]:+.0%}")
    for k, v in result.params.items():
        print(f"  {k} = {v:.4g}")
    for r in result.loo:
        print(f"  run {r['run_id']}: measured {r['measured_s']:.3f} s, predicted {r['predicted_s']:.3f} s ({r['error_pct']:+.1f}%)")
    return 0
