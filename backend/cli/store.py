"""Experiment store commands: submit, list, show, cancel, requeue, delete, tag, export, worker, gc.

Every command takes `--db URL` (else SHARDLAB_DB_URL, else <repo>/data/shardlab.db).
`submit --sweep GRID.json` queues every valid grid point under one sweep id and reports the invalid
ones on stderr (exit 0 if any point was queued, 2 if none); `--strict` queues nothing if any point is invalid.
Text people typed (names, tags, errors) is printed with control characters escaped, so it cannot move the
cursor or fake rows. A store that cannot be used (its SQLite file gone or replaced) exits 2 with the reason.
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
from backend.spec_text import InputError, load_json_file, printable
from db.session import StoreError


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
    p.add_argument("--recover-every-s", type=float, help="look for dead workers' jobs this often while polling "
                   "(default: stale-after-s / 4, between 2 and 30)")
    p.add_argument("--min-free-mb", type=float, default=64.0, help="pause claiming while the runs folder has less free "
                   "space (default 64)")
    p.add_argument("--max-backoff-s", type=float, default=30.0, help="longest wait between tries while the store is "
                   "unavailable (default 30)")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("gc", help="remove folders finished or deleted runs left behind (run folders, temp folders)")
    _db(p)
    p.add_argument("--runs-dir", type=Path, help="run folders (default: runs/ beside the SQLite file; the SLURM run_dir too)")
    p.add_argument("--older-than-h", type=float, default=1.0, help="temp folders must be this old (default 1)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_gc)
    for parser in sub.choices.values():  # every store command: an unusable store is exit 2 with the reason
        if parser.get_default("func") in _GUARDED:
            parser.set_defaults(func=_guarded(parser.get_default("func")))


def _engine(args):
    from db.session import open_db

    return open_db(args.db)


def _guarded(func):
    """An unusable store exits 2 with the reason; an unreachable or read-only one exits 1 with the driver's
    first line (never a traceback)."""
    def run(args) -> int:
        from backend.store_guard import is_transient, short

        try:
            return func(args)
        except StoreError as e:
            return fail(str(e))
        except Exception as e:  # noqa: BLE001
            if not is_transient(e):
                raise
            print(f"error: the store is unavailable ({short(e)}); nothing was changed", file=sys.stderr)
            return 1

    run.__wrapped__ = func
    return run


def _dump(obj) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False, default=lambda o: o.isoformat() if hasattr(o, "isoformat") else str(o))


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
        eid = q.submit_experiment(_engine(args), spec, tags=args.tag)
    except InputError as e:
        return fail(str(e))
    print(_dump({"ids": [eid]}) if args.json else eid)
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
        sweep_id, ids, invalid = submit_sweep(_engine(args), base, grid, tags=args.tag)
    except InputError as e:
        return fail(str(e))
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
        tags = f" [{', '.join(printable(t) for t in r['tags'])}]" if r["tags"] else ""
        print(f"{r['id']:>5} {r['status']:<11} {r['strategy']:<8} {r['world_size']:>5} {degrees:<12} {printable(prog):<14} "
              f"{step:>8} {tps:>9}  {printable(r['name'])}{tags}")
    return 0


def cmd_show(args) -> int:
    from db import queries as q

    row = q.get_experiment(_engine(args), args.id)
    if row is None:
        print(f"error: no experiment with id {args.id}", file=sys.stderr)
        return 1
    if args.json:
        print(_dump(experiment_json(row)))
        return 0
    spec, result = row.pop("spec"), row.pop("result")
    for k, v in row.items():
        if v not in (None, "", [], {}) and k not in ("log_tail", "traceback", "env"):
            print(f"{k:>18}: {printable(', '.join(v) if k == 'tags' else v)}")
    if result is not None and result.imported is not None:  # a log's allocator peaks, not tracked categories
        print(f"\nimported from {result.imported.framework}; rank  peak_allocated  peak_reserved  predicted_total  step_s_median")
        for r in result.per_rank:
            med = sorted(r.step_s)[len(r.step_s) // 2] if r.step_s else None
            print(f"{r.rank:>4}  {r.cuda_max_allocated_bytes if r.cuda_max_allocated_bytes is not None else '-':>14}  "
                  f"{r.cuda_max_reserved_bytes if r.cuda_max_reserved_bytes is not None else '-':>13}  "
                  f"{r.predicted.peak_bytes:>15}  {med if med is not None else '-'}")
    elif result is not None:
        print("\nrank  measured_peak  predicted_peak  step_s_median")
        for r in result.per_rank:
            med = sorted(r.step_s)[len(r.step_s) // 2] if r.step_s else None
            print(f"{r.rank:>4}  {r.measured.peak_bytes:>13}  {r.predicted.peak_bytes:>14}  {med if med is not None else '-'}")
    if row.get("log_tail") and row["status"] != "ok":
        print("\nlog tail:\n" + row["log_tail"])
    print("\nspec:\n" + spec.to_json())
    return 0


def experiment_json(row: dict) -> dict:
    """`show ID --json`: the row's columns, its spec and its result as JSON (import-run --json prints the same)."""
    row = dict(row)
    spec, result = row.pop("spec"), row.pop("result")
    return {**row, "spec": spec.model_dump(mode="json"),
            "result": result.model_dump(mode="json", by_alias=True) if result else None}


def dump_json(obj) -> str:
    return _dump(obj)


def _lifecycle(args, action) -> int:
    from db import queries as q

    try:
        print(action(q, _engine(args), args.id))
    except q.NotFound as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except InputError as e:
        return fail(str(e))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_cancel(args) -> int:
    return _lifecycle(args, lambda q, e, i: q.cancel_experiment(e, i))


def cmd_requeue(args) -> int:
    return _lifecycle(args, lambda q, e, i: q.requeue_experiment(e, i))


def cmd_delete(args) -> int:
    from backend.run_folders import delete_run

    def delete(_q, engine, i) -> str:
        removed = delete_run(engine, i)
        return f"deleted {i}" + "".join(f"; removed its run folder {f}" for f in removed)

    return _lifecycle(args, delete)


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
    """Exit 0 when stopped or done; 2 when the store cannot be used (its file gone); it waits out outages."""
    from backend.worker import Worker, install_signal_handlers
    from db.session import get_engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    worker = Worker(get_engine(args.db), runs_dir=args.runs_dir, poll_s=args.poll_s, heartbeat_s=args.heartbeat_s,
                    stale_after_s=args.stale_after_s, recover_every_s=args.recover_every_s,
                    min_free_bytes=int(args.min_free_mb * 2**20))
    worker.max_backoff_s = args.max_backoff_s
    install_signal_handlers(worker)
    if args.exit_with is not None:
        from backend.ui.worker_ctl import follow_parent

        follow_parent(args.exit_with, worker.stop)
    return worker.serve(once=args.once, drain=args.drain, concurrency=args.concurrency)


def cmd_gc(args) -> int:
    from backend.cleanup import collect
    from backend.run_folders import default_runs_dir

    engine = _engine(args)
    runs = [args.runs_dir or default_runs_dir(engine)]
    try:
        from backend.cluster.config import load

        runs.append(load().run_dir)
    except ValueError:
        pass
    report = collect(engine, runs, older_than_s=args.older_than_h * 3600, dry_run=args.dry_run)
    if args.json:
        print(_dump({"removed": report.removed, "bytes": report.bytes, "kept_in_use": report.kept_in_use,
                     "dry_run": report.dry_run}))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for r in report.removed:
        print(f"{verb} {r['path']} ({r['bytes'] / 2**20:.1f} MiB): {r['why']}")
    print(f"{verb} {len(report.removed)} folder(s), {report.bytes / 2**20:.1f} MiB; kept {report.kept_in_use} in use or recent",
          file=sys.stderr)
    return 0


_GUARDED = {cmd_submit, cmd_list, cmd_show, cmd_cancel, cmd_requeue, cmd_delete, cmd_tag, cmd_export, cmd_worker, cmd_gc}
