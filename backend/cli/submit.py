"""`submit`: queue an experiment, or a sweep, for the worker.

`submit --sweep GRID.json` queues every valid grid point under one sweep id and reports the invalid ones on stderr
(exit 0 if any point was queued, 2 if none); `--strict` queues nothing if any point is invalid. A local spec must fit
this host (backend/launch/capacity.py) and a SLURM one the cluster config, else nothing is queued (exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from backend.cli import fail
from backend.cli.spec_flags import add_spec_flags, spec_dict_from_args, spec_from_args
from backend.cli.store_options import add_db_flag, dump_json, guarded, open_store
from backend.spec.user_text import InputError, load_json_file


def add_flags(p: argparse.ArgumentParser) -> None:
    add_spec_flags(p)
    add_db_flag(p)
    p.add_argument("--tag", action="append", default=[], help="repeatable")
    p.add_argument("--sweep", type=Path, metavar="GRID.json",
                   help='grid {"strategy": ["ddp", "zero2"], "world": [2, 4]}')
    p.add_argument("--strict", action="store_true", help="with --sweep: queue nothing if any point is invalid")
    p.add_argument("--json", action="store_true", help="print {sweep_id, ids, invalid} as JSON")
    p.set_defaults(func=guarded(cmd_submit))


def cmd_submit(args) -> int:
    """Queue one spec (or a sweep); exit 2 for an invalid spec, tag or unusable store."""
    from db import queries as q

    if args.sweep:
        return _submit_sweep(args)
    spec, problems = spec_from_args(args)
    if spec is None:
        return fail("invalid spec:\n  " + "\n  ".join(problems))
    if spec.runtime.executor == "slurm":
        from backend.cluster.submit import cluster_problem

        problem = cluster_problem(spec)
        if problem:
            return fail(problem)
    else:
        from backend.launch import capacity

        verdict = capacity.check(spec)
        for warning in verdict.warnings:
            print(f"warning: {warning}", file=sys.stderr)
        if not verdict.ok:
            return fail(f"nothing queued: {verdict.refusal()}")
    try:
        eid = q.submit_experiment(open_store(args), spec, tags=args.tag)
    except InputError as e:
        return fail(str(e))
    print(dump_json({"ids": [eid]}) if args.json else eid)
    return 0


def _submit_sweep(args) -> int:
    from backend.sweep import expand_grid, submit_sweep

    try:
        base = spec_dict_from_args(args)
        grid = load_json_file(args.sweep, "sweep grid")
        valid, invalid = expand_grid(base, grid)
    except (OSError, ValueError) as e:
        return fail(f"cannot use sweep {args.sweep}: {e}")
    for bad in invalid:
        print(f"invalid point {json.dumps(bad['point'])}: " + "; ".join(bad["problems"]), file=sys.stderr)
    if not valid or (invalid and args.strict):
        return fail(f"{len(invalid)} of {len(valid) + len(invalid)} sweep points are invalid; nothing queued")
    try:
        sweep_id, ids, invalid = submit_sweep(open_store(args), base, grid, tags=args.tag)
    except InputError as e:
        return fail(str(e))
    print(f"sweep {sweep_id}: queued {len(ids)}, skipped {len(invalid)} invalid", file=sys.stderr)
    print(dump_json({"sweep_id": sweep_id, "ids": ids, "invalid": invalid}) if args.json else "\n".join(map(str, ids)))
    return 0
