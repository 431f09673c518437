"""`export`: experiments as CSV (one row per experiment, or per rank with --long) or JSON (db/export.py)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import TextIO

from backend.cli import fail
from backend.cli.store_options import add_db_flag, add_filter_flags, filter_kwargs, guarded, open_store
from backend.spec.user_text import printable


def add_flags(p: argparse.ArgumentParser) -> None:
    add_db_flag(p)
    add_filter_flags(p)
    p.add_argument("--format", choices=("csv", "json"), default="csv")
    p.add_argument("--long", action="store_true", help="CSV: one row per (experiment, rank)")
    # a str, not a Path: Path("./-") is Path("-"), and ./- is how a file named "-" is written
    p.add_argument("-o", "--output", help="file (default, or -: stdout)")
    p.set_defaults(func=guarded(cmd_export))


STDOUT = "-"
"""`-o -`: standard output, the Unix convention (not a file named "-")."""


def cmd_export(args) -> int:
    from db.export import export_csv, export_json

    engine, filters = open_store(args), filter_kwargs(args)
    try:
        target = _output(args.output)
    except OSError as e:
        return fail(f"cannot write -o '{printable(args.output)}': {e.strerror or e}")
    with target as out:
        if args.format == "csv":
            export_csv(engine, out, long=args.long, **filters)
        else:
            export_json(engine, out, **filters)
    return 0


def _output(path: str | None) -> contextlib.AbstractContextManager[TextIO]:
    """Standard output (no -o, or -o -), else the file, opened before anything is read from the store."""
    if path is None or path == STDOUT:
        return contextlib.nullcontext(sys.stdout)
    return open(path, "w", encoding="utf-8", newline="")
