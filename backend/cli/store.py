"""Experiment store commands: submit, list, show, cancel, requeue, delete, tag, export, worker.

Every command takes `--db URL` (else SHARDLAB_DB_URL, else <repo>/data/shardlab.db).
`submit --sweep GRID.json` queues every valid grid point under one sweep id and reports the invalid
ones on stderr (exit 0 if any point was queued, 2 if none); `--strict` queues nothing if any point is invalid.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from backend.cli import fail
from backend.cli.spec_flags import add_spec_flags, spec_dict_from_args, spec_from_args
from backend.result import Status
from backend.spec import Strategy


def _db(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", metavar="URL", help="database URL (default: $SHARDLAB_DB_URL or <repo>/data/shardlab.db)")


def _filters(p: argparse.ArgumentParser) -> None:
    p.add_argument("--status", action="append", choices=[s.value for s in Status], help="repeatable")
    p.add_argument("--strategy", action="append", choices=[s.value for s in Strategy], help="repeatable")
    p.add_argument("--tag", action="append", help="repeatable: every tag must be present")
    p.add_argument("--sweep", dest="sweep_id", help="sweep id")
    p.add_argument("--search", help="text in name, error, sweep id or tags; or an id")


def _filter_kwargs(args) -> dict:
    return {"status": args.status, "strategy": args.strategy, "tag": args.tag, "sweep_id": args.sweep_id, "search": args.search}


def register(sub) -> None:
    p = sub.add_parser("submit", help="queue an experiment (or a sweep) for the worker")
    add_spec_flags(p)
    _db(p)
    p.add_argument("--tag", action="append", default=[], help="repeatable")
    p.add_argument("--sweep", type=Path, metavar="GRID.json", help='grid {"strategy": ["ddp", "zero2"], "world": [2, 4]}')
    p.add_argument("--strict", action="store_true", help="with --sweep: queue nothing if any point is invalid")
    p.add_argument("--json", action="store_true", help="print {sweep_id, ids, invalid} as JSON")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("list", help="list experiments, newest first")
    _db(p)
    _filters(p)
    p.add_argument("--limit", type=int, default=50, help="rows (0 = all; default 50)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="one experiment with its spec and result")
    _db(p)
    p.add_argument("id", type=int)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_show)

    for name, func, help_ in (("cancel", cmd_cancel, "cancel a queued or running experiment"),
                              ("requeue", cmd_requeue, "queue a finished experiment again (as a new row)"),
                              ("delete", cmd_delete, "delete an experiment and its results")):
        p = sub.add_parser(name, help=help_)
        _db(p)
        p.add_argument("id", type=int)
        p.set_defaults(func=func)

    p = sub.add_parser("tag", help="replace an experiment's tags")
    _db(p)
    p.add_argument("id", type=int)
    p.add_argument("tags", nargs="*")
    p.set_defaults(func=cmd_tag)

    p = sub.add_parser("export", help="export experiments as CSV or JSON")
    _db(p)
    _filters(p)
    p.add_argument("--format", choices=("csv", "json"), default="csv")
    p.add_argument("--long", action="store_true", help="CSV: one row per (experiment, rank)")
    p.add_argument("-o", "--output", type=Path, help="file (default: stdout)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("worker", help="run queued experiments one at a time")
    _db(p)
    p.add_argument("--once", action="store_true", help="run at most one job, then exit")
    p.add_argument("--drain", action="store_true", help="run until the queue is empty, then exit")
    p.add_argument("--poll-s", type=float, default=1.0, help="queue poll interval (default 1)")
    p.add_argument("--concurrency", type=int, default=1, help="jobs at once (default 1)")
    p.add_argument("--heartbeat-s", type=float, default=5.0)
    p.add_argument("--stale-after-s", type=float, default=60.0, help="a running job without heartbeat this long is interrupted")
    p.add_argument("--runs-dir", type=Path, help="job work folders (default: runs/ beside the SQLite file)")
    p.add_argument("--exit-with", type=int, metavar="PID", help="stop when process PID exits, as on SIGTERM (the "
                   "dashboard passes its own pid to the worker it starts)")
    p.set_defaults(func=cmd_worker)


def _engine(args):
    from db.session import open_db

    return open_db(args.db)


def _dump(obj) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False, default=lambda o: o.isoformat() if hasattr(o, "isoformat") else str(o))


def cmd_submit(args) -> int:
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
    eid = q.submit_experiment(_engine(args), spec, tags=args.tag)
    print(_dump({"ids": [eid]}) if args.json else eid)
    return 0


def _submit_sweep(args) -> int:
    from backend.sweep import expand_grid, submit_sweep

    try:
        base = spec_dict_from_args(args)
        grid = json.loads(args.sweep.read_text())
        valid, invalid = expand_grid(base, grid)
    except (OSError, json.JSONDecodeError, ValueError) as e:
        return fail(f"cannot use sweep {args.sweep}: {e}")
    for bad in invalid:
        print(f"invalid point {json.dumps(bad['point'])}: " + "; ".join(bad["problems"]), file=sys.stderr)
    if not valid or (invalid and args.strict):
        return fail(f"{len(invalid)} of {len(valid) + len(invalid)} sweep points are invalid; nothing queued")
    sweep_id, ids, invalid = submit_sweep(_engine(args), base, grid, tags=args.tag)
    print(f"sweep {sweep_id}: queued {len(ids)}, skipped {len(invalid)} invalid", file=sys.stderr)
    print(_dump({"sweep_id": sweep_id, "ids": ids, "invalid": invalid}) if args.json else "\n".join(map(str, ids)))
    return 0


def cmd_list(args) -> int:
    from db import queries as q

    rows = q.list_experiments(_engine(args), limit=args.limit or None, **_filter_kwargs(args))
    if args.json:
        print(_dump(rows))
        return 0
    print(f"{'id':>5} {'status':<11} {'strategy':<8} {'world':>5} {'dp×tp×pp×ep':<12} {'progress':<14} {'step_s':>8} "
          f"{'tokens/s':>9}  name [tags]")
    for r in rows:
        prog = f"{r['progress_phase'] or ''} {r['progress_step']}/{r['progress_total']}" if r["progress_total"] else ""
        degrees = f"{r['dp']}×{r['tp']}×{r['pp']}×{r['ep']}"
        step = f"{r['step_s_median']:.4f}" if r["step_s_median"] is not None else "-"
        tps = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] is not None else "-"
        tags = f" [{', '.join(r['tags'])}]" if r["tags"] else ""
        print(f"{r['id']:>5} {r['status']:<11} {r['strategy']:<8} {r['world_size']:>5} {degrees:<12} {prog:<14} {step:>8} "
              f"{tps:>9}  {r['name']}{tags}")
    return 0


def cmd_show(args) -> int:
    from db import queries as q

    row = q.get_experiment(_engine(args), args.id)
    if row is None:
        print(f"error: no experiment with id {args.id}", file=sys.stderr)
        return 1
    spec, result = row.pop("spec"), row.pop("result")
    if args.json:
        out = {**row, "spec": spec.model_dump(mode="json"), "result": result.model_dump(mode="json", by_alias=True) if result else None}
        print(_dump(out))
        return 0
    for k, v in row.items():
        if v not in (None, "", [], {}) and k not in ("log_tail", "traceback", "env"):
            print(f"{k:>18}: {v}")
    if result is not None:
        print("\nrank  measured_peak  predicted_peak  step_s_median")
        for r in result.per_rank:
            med = sorted(r.step_s)[len(r.step_s) // 2] if r.step_s else None
            print(f"{r.rank:>4}  {r.measured.peak_bytes:>13}  {r.predicted.peak_bytes:>14}  {med if med is not None else '-'}")
    if row.get("log_tail") and row["status"] != "ok":
        print("\nlog tail:\n" + row["log_tail"])
    print("\nspec:\n" + spec.to_json())
    return 0


def _lifecycle(args, action) -> int:
    from db import queries as q

    try:
        print(action(q, _engine(args), args.id))
    except q.NotFound as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_cancel(args) -> int:
    return _lifecycle(args, lambda q, e, i: q.cancel_experiment(e, i))


def cmd_requeue(args) -> int:
    return _lifecycle(args, lambda q, e, i: q.requeue_experiment(e, i))


def cmd_delete(args) -> int:
    return _lifecycle(args, lambda q, e, i: q.delete_experiment(e, i) or f"deleted {i}")


def cmd_tag(args) -> int:
    return _lifecycle(args, lambda q, e, i: json.dumps(q.set_tags(e, i, args.tags), ensure_ascii=False))


def cmd_export(args) -> int:
    from db.export import export_csv, export_json

    engine, filters = _engine(args), _filter_kwargs(args)
    out = open(args.output, "w", encoding="utf-8", newline="") if args.output else sys.stdout
    try:
        if args.format == "csv":
            export_csv(engine, out, long=args.long, **filters)
        else:
            export_json(engine, out, **filters)
    finally:
        if args.output:
            out.close()
    return 0


def cmd_worker(args) -> int:
    from backend.worker import Worker, install_signal_handlers

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    worker = Worker(_engine(args), runs_dir=args.runs_dir, poll_s=args.poll_s, heartbeat_s=args.heartbeat_s,
                    stale_after_s=args.stale_after_s)
    install_signal_handlers(worker)
    if args.exit_with is not None:
        from backend.ui.worker_ctl import follow_parent

        follow_parent(args.exit_with, worker.stop)
    return worker.serve(once=args.once, drain=args.drain, concurrency=args.concurrency)
