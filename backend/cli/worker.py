"""`worker`: run queued experiments (backend/worker/); `gc`: remove what finished or deleted runs left behind."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from backend.cli import fail
from backend.cli.store_options import add_db_flag, dump_json, guarded, open_store


def add_worker_flags(p: argparse.ArgumentParser) -> None:
    add_db_flag(p)
    p.add_argument("--once", action="store_true", help="run at most one job, then exit")
    p.add_argument("--drain", action="store_true", help="run until the queue is empty, then exit")
    p.add_argument("--poll-s", type=float, default=1.0, help="queue poll interval (default 1)")
    p.add_argument("--concurrency", type=int, default=1, help="jobs at once (default 1)")
    p.add_argument("--heartbeat-s", type=float, default=5.0)
    p.add_argument("--stale-after-s", type=float, default=60.0, help="a running job without heartbeat this long is "
                                                                     "interrupted")
    p.add_argument("--runs-dir", type=Path, help="job work folders (default: runs/ beside the SQLite file)")
    p.add_argument("--exit-with", type=int, metavar="PID", help="stop when process PID exits, as on SIGTERM (the "
                   "dashboard passes its own pid to the worker it starts)")
    p.add_argument("--recover-every-s", type=float, help="look for dead workers' jobs this often while polling "
                   "(default: stale-after-s / 4, between 2 and 30)")
    p.add_argument("--min-free-mb", type=float, default=64.0, help="pause claiming while the runs folder has less free "
                   "space (default 64)")
    p.add_argument("--max-backoff-s", type=float, default=30.0, help="longest wait between tries while the store is "
                   "unavailable (default 30)")
    p.add_argument("--stop-grace-s", type=float, default=10.0, help="after SIGTERM / SIGINT, how long the worker's "
                   "last store writes may take before it exits (default 10; a result not stored stays in result.json)")
    p.set_defaults(func=guarded(cmd_worker))


def add_gc_flags(p: argparse.ArgumentParser) -> None:
    add_db_flag(p)
    p.add_argument("--runs-dir", type=Path, help="run folders (default: runs/ beside the SQLite file; the SLURM "
                                                 "run_dir too)")
    p.add_argument("--older-than-h", type=float, default=1.0, help="temp folders must be this old (default 1)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=guarded(cmd_gc))


def cmd_worker(args) -> int:
    """Exit 0 when stopped or done; 2 when the store cannot be used (its file gone); it waits out outages."""
    from backend.worker.lifetime import follow_parent, install_signal_handlers
    from backend.worker.service import Worker
    from db.session import get_engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    worker = Worker(get_engine(args.db), runs_dir=args.runs_dir, poll_s=args.poll_s, heartbeat_s=args.heartbeat_s,
                    stale_after_s=args.stale_after_s, recover_every_s=args.recover_every_s,
                    min_free_bytes=int(args.min_free_mb * 2**20))
    worker.max_backoff_s, worker.stop_grace_s = args.max_backoff_s, args.stop_grace_s
    install_signal_handlers(worker)
    if args.exit_with is not None:
        follow_parent(args.exit_with, worker.stop)
    return worker.serve(once=args.once, drain=args.drain, concurrency=args.concurrency)


def cmd_gc(args) -> int:
    from backend.worker.cleanup import collect, owned_runs_dirs, runs_dirs

    if not args.older_than_h >= 0:  # a negative age put the cutoff in the future: a starting run's folders went too
        return fail(f"--older-than-h must be >= 0 hours (got {args.older_than_h:g}); nothing was removed")
    engine = open_store(args)
    report = collect(engine, runs_dirs(engine, args.runs_dir), owned=owned_runs_dirs(engine, args.runs_dir),
                     older_than_s=args.older_than_h * 3600, dry_run=args.dry_run)
    if args.json:
        print(dump_json({"removed": report.removed, "bytes": report.bytes, "kept_in_use": report.kept_in_use,
                     "dry_run": report.dry_run}))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for r in report.removed:
        print(f"{verb} {r['path']} ({r['bytes'] / 2**20:.1f} MiB): {r['why']}")
    print(f"{verb} {len(report.removed)} folder(s), {report.bytes / 2**20:.1f} MiB; kept {report.kept_in_use} in use "
          "or recent",
          file=sys.stderr)
    return 0
