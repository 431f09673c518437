"""`export`: experiments as CSV (one row per experiment, or per rank with --long) or JSON (db/export.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from backend.cli.store_options import add_db_flag, add_filter_flags, filter_kwargs, guarded, open_store


def add_flags(p: argparse.ArgumentParser) -> None:
    add_db_flag(p)
    add_filter_flags(p)
    p.add_argument("--format", choices=("csv", "json"), default="csv")
    p.add_argument("--long", action="store_true", help="CSV: one row per (experiment, rank)")
    p.add_argument("-o", "--output", type=Path, help="file (default: stdout)")
    p.set_defaults(func=guarded(cmd_export))


def cmd_export(args) -> int:
    from db.export import export_csv, export_json

    engine, filters = open_store(args), filter_kwargs(args)
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
