"""`python -m backend calibrate`: fit the step-time model to stored runs (ShardLab's own and imported ones) and store
the result as a calibration, optionally a named profile of your cluster.

  python -m backend calibrate --tag ourcluster --hardware h100-sxm --name h100-ourcluster --json
  python -m backend calibrate --tag cal-w2 --hardware cpu
  python -m backend plan ... --hardware h100-ourcluster          # estimate / plan take the name (or --calibration ID)

The fit is backend/calibration/profile_fit.fit_profile: on the runs' measured step times (and, for ShardLab's own
runs, seconds per collective and pipeline phases), as many parameters as the runs support. Runs measured on another
device than --hardware's are left out with the reason. Prints {"id", "name", "hardware", "params", "fit_runs",
"kinds", "residuals", "loo", "loo_mape", "interval", "ranges", "notes"} with --json.
"""

from __future__ import annotations

import argparse
import json

from backend.cli import fail

MAX_NAME = 64


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="fit step-time parameters to stored runs", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--tag", help="use the ok runs with this tag")
    g.add_argument("--ids", help="comma-separated run ids")
    p.add_argument("--hardware", default="cpu", help="profile to calibrate (default: cpu), or a calibrated profile's "
                   "name to refit it")
    p.add_argument("--name", help=f"store it as a named profile (<= {MAX_NAME} characters: letters, digits, . _ -) that "
                   "--hardware accepts, e.g. h100-ourcluster")
    p.add_argument("--db", metavar="URL", help="database URL (default: $SHARDLAB_DB_URL or <repo>/data/shardlab.db)")
    p.add_argument("--no-loo", action="store_true", help="skip the leave-one-out refits (no MAPE, default interval)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def _name_problem(name: str | None) -> str | None:
    import re

    from backend.analytic.steptime.hardware import load_profiles

    if name is None:
        return None
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", name):
        return f"--name {name!r}: letters, digits, '.', '_' and '-' only, at most {MAX_NAME} characters"
    if name in load_profiles():
        return f"--name {name!r} is a shipped hardware profile: choose another name for the calibrated one"
    return None


def run(args: argparse.Namespace) -> int:
    from backend.analytic.steptime.hardware import get_hardware, load_profiles
    from backend.calibration import store
    from backend.calibration.profile_fit import fit_profile
    from db import queries as q
    from db.session import open_db

    try:
        ids = [int(x) for x in args.ids.split(",") if x.strip()] if args.ids else None
    except ValueError:
        return fail(f"--ids must be comma-separated integers (got {args.ids!r})")
    if problem := _name_problem(args.name):
        return fail(problem)
    engine = open_db(args.db)
    base, name = args.hardware, args.name
    if base not in load_profiles():
        named = store.latest_named(engine, base)
        if named is None:
            try:
                get_hardware(base)
            except ValueError as e:
                return fail(str(e))
        base, name = named["hardware"], name or named["name"]
    hw = get_hardware(base)
    samples, problems = store.samples(engine, tag=args.tag, ids=ids, hardware=hw.key)
    if problems and ids:
        return fail("; ".join(problems))
    try:
        result = fit_profile(hw, samples, loo=not args.no_loo)
    except ValueError as e:
        return fail(str(e) + (f" ({'; '.join(problems)})" if problems else ""))
    run_ids = [s.run_id for s in samples]
    kinds: dict[str, int] = {}
    for i in run_ids:
        kind = (q.get_experiment(engine, i) or {}).get("kind", "measured")
        kinds[kind] = kinds.get(kind, 0) + 1
    cal_id = store.save(engine, hw.key, result, run_ids, name=name, kinds=kinds)
    out = {"id": cal_id, "name": name, "hardware": hw.key, "params": result.params, "fit_runs": run_ids, "kinds": kinds,
           "residuals": result.residuals, "loo": result.loo, "loo_mape": result.loo_mape, "interval": list(result.band),
           "ranges": result.ranges, "notes": result.notes + problems}
    if args.json:
        print(json.dumps(out))
        return 0
    label = f"profile {name!r} (calibration {cal_id})" if name else f"calibration {cal_id}"
    print(f"{label} of {hw.key}: {len(run_ids)} runs ({', '.join(f'{n} {k}' for k, n in kinds.items())}), leave-one-out "
          f"MAPE {'-' if result.loo_mape is None else f'{result.loo_mape:.1f}%'}, interval "
          f"{result.band[0]:+.0%}..{result.band[1]:+.0%}")
    for k, v in result.params.items():
        print(f"  {k} = {v:.4g}")
    loo = {r["run_id"]: r for r in result.loo}
    for r in result.residuals:
        left_out = loo.get(r["run_id"])
        print(f"  run {r['run_id']}: measured {r['measured_s']:.3f} s, fit {r['predicted_s']:.3f} s "
              f"({r['residual_pct']:+.1f}%)" + (f", left out {left_out['predicted_s']:.3f} s ({left_out['error_pct']:+.1f}%)"
                                                if left_out else ""))
    for n in problems:
        print(f"  note: {n}")
    return 0
