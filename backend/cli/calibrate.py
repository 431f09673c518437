"""`python -m backend calibrate`: fit the step-time model to stored runs (ShardLab's own and imported ones) and store
the result as a calibration, optionally a named profile of your cluster.

  python -m backend calibrate --tag ourcluster --hardware h100-sxm --name h100-ourcluster --json
  python -m backend calibrate --tag cal-w2 --hardware cpu
  python -m backend plan ... --hardware h100-ourcluster          # estimate / plan take the name (or --calibration ID)

The fit is backend/calibration/profile_fit.fit_profile: on the runs' measured step times (and, for ShardLab's own
runs, seconds per collective and pipeline phases), as many parameters as the runs support, in order: a scale on the
profile's GEMM table (or size curve), fixed overhead, overlap, link efficiency, a scale on each operation table the
profile has (attention, element-wise, optimizer; backend/calibration/fit.py fitted_params), kernel floor; on CPU
profiles also latency, the DTensor dispatch cost and all-gather / reduce-scatter bandwidth. Runs measured on another
device than --hardware's are left out with the reason. Prints {"id", "name", "hardware", "params", "fit_runs",
"kinds", "residuals", "loo", "loo_mape", "uncalibrated", "uncalibrated_mape", "interval", "ranges", "notes"} with
--json ("uncalibrated": each run on the profile itself, before the fit; a note says when the fit is worse).
"""

from __future__ import annotations

import argparse
import json

from backend.cli import fail

MAX_NAME = 64

def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--tag", help="use the ok runs with this tag")
    g.add_argument("--ids", help="comma-separated run ids")
    p.add_argument("--hardware", default="cpu", help="profile to calibrate (default: cpu), or a calibrated profile's "
                   "name to refit it")
    p.add_argument("--name", help=f"store it as a named profile (<= {MAX_NAME} characters: letters, digits, . _ -) "
                   "that --hardware accepts, e.g. h100-ourcluster")
    p.add_argument("--db", metavar="URL", help="database URL (default: $SHARDLAB_DB_URL or <repo>/data/shardlab.db)")
    p.add_argument("--no-loo", action="store_true", help="skip the leave-one-out refits (no MAPE, default interval)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from backend.calibration.calibrate import calibrate
    from db.session import open_db

    try:
        ids = [int(x) for x in args.ids.split(",") if x.strip()] if args.ids else None
    except ValueError:
        return fail(f"--ids must be comma-separated integers (got {args.ids!r})")
    try:
        out = calibrate(open_db(args.db), hardware=args.hardware, tag=args.tag, ids=ids, name=args.name,
                        loo=not args.no_loo)
    except ValueError as e:
        return fail(str(e).replace("name ", "--name ", 1) if str(e).startswith("name ") else str(e))
    if args.json:
        print(json.dumps(out))
        return 0
    name, cal_id = out["name"], out["id"]
    label = f"profile {name!r} (calibration {cal_id})" if name else f"calibration {cal_id}"
    band = out["interval"]
    mape = "-" if out["loo_mape"] is None else f"{out['loo_mape']:.1f}%"
    kinds = ", ".join(f"{n} {k}" for k, n in out["kinds"].items())
    print(f"{label} of {out['hardware']}: {len(out['fit_runs'])} runs ({kinds}), leave-one-out MAPE {mape} "
          f"(uncalibrated {out['uncalibrated_mape']:.1f}%), interval {band[0]:+.0%}..{band[1]:+.0%}")
    for k, v in out["params"].items():
        print(f"  {k} = {v:.4g}")
    loo = {r["run_id"]: r for r in out["loo"]}
    before = {r["run_id"]: r for r in out["uncalibrated"]}
    for r in out["residuals"]:
        left_out, b = loo.get(r["run_id"]), before[r["run_id"]]
        print(f"  run {r['run_id']}: measured {r['measured_s']:.3f} s, uncalibrated {b['predicted_s']:.3f} s "
              f"({b['error_pct']:+.1f}%), fit {r['predicted_s']:.3f} s "
              f"({r['residual_pct']:+.1f}%)" + (f", left out {left_out['predicted_s']:.3f} s "
                                                f"({left_out['error_pct']:+.1f}%)"
                                                if left_out else ""))
    for n in out["notes"]:
        print(f"  note: {n}")
    return 0
