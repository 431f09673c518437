"""`python -m backend ingest DIR`: store the runs of a GPU check (benchmarks/gpu_check.py --out DIR) as ordinary
results, tagged with the GPU they ran on; ingesting the same folder again stores nothing new.

  python -m backend ingest benchmarks/results/gpu/2026-11-26-h200 [--db URL] [--json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from backend.cli import fail


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("folder", type=Path, help="the folder holding the check's report.json")
    p.add_argument("--db", metavar="URL", help="database URL (default: $SHARDLAB_DB_URL or <repo>/data/shardlab.db)")
    p.add_argument("--json", action="store_true", help="print one JSON list: {run, status, experiment_id, action}")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from backend.gpucheck.ingest import ingest_report, read_report

    try:
        report = read_report(args.folder)
    except ValueError as e:
        return fail(str(e))
    from db.session import open_db

    rows = ingest_report(open_db(args.db), report)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            where = f"experiment {r['experiment_id']}" if r["experiment_id"] else r.get("reason") or "-"
            print(f"{r['run']:<18} {str(r['status']):<9} {r['action']:<8} {where}")
        print(f"{sum(r['action'] == 'stored' for r in rows)} stored, {sum(r['action'] == 'already' for r in rows)} "
              f"already stored, {sum(r['action'] == 'skipped' for r in rows)} not measured")
    return 0
