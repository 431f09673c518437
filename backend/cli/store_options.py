"""What every experiment-store command shares: `--db URL` (else SHARDLAB_DB_URL, else <repo>/data/shardlab.db), the
run filters, JSON output, and `guarded`: a store that cannot be used (its SQLite file gone or replaced) exits 2 with
the reason, an unreachable or read-only one exits 1 with the driver's first line, never a traceback."""

from __future__ import annotations

import argparse
import json
import math
import sys

from backend.cli import fail
from backend.result import Status
from backend.spec import Strategy
from db.filters import MAX_ID
from db.session import StoreError


def add_db_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", metavar="URL", help="database URL (default: $SHARDLAB_DB_URL or <repo>/data/shardlab.db)")


def run_id(text: str) -> int:
    """argparse type of a run's id: a number the store's integer ids can hold (a longer one overflowed the driver)."""
    value = int(text)  # ValueError: argparse says "invalid run_id value"
    if not 0 <= value <= MAX_ID:
        raise argparse.ArgumentTypeError(f"{text} is not a run id (a number from 1 to {MAX_ID})")
    return value


def row_limit(text: str) -> int:
    """argparse type of --limit: 0 (all) or a row count the database takes (PostgreSQL refuses a negative one)."""
    value = int(text)
    if not 0 <= value <= MAX_ID:
        raise argparse.ArgumentTypeError(f"--limit {text}: give 0 (all rows) or a positive number of rows")
    return value


def add_filter_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--status", action="append", choices=[s.value for s in Status], help="repeatable")
    p.add_argument("--strategy", action="append", choices=[s.value for s in Strategy], help="repeatable")
    p.add_argument("--tag", action="append", help="repeatable: every tag must be present")
    p.add_argument("--sweep", dest="sweep_id", help="sweep id")
    p.add_argument("--search", help="text in name, error, sweep id or tags; or an id")


def filter_kwargs(args) -> dict:
    return {"status": args.status, "strategy": args.strategy, "tag": args.tag, "sweep_id": args.sweep_id,
            "search": args.search}


def open_store(args):
    from db.session import open_db

    return open_db(args.db)


def guarded(func):
    """`func(args)` with the store's failures turned into exit codes (see the module docstring)."""
    def run(args) -> int:
        from backend.worker.store_guard import is_transient, short

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


def dump_json(obj) -> str:
    """Standard JSON: NaN and +-inf (a diverged run's losses) as the strings "NaN", "Infinity", "-Infinity", as
    RunResult writes them (pydantic reads them back as floats); never the bare NaN token strict parsers refuse."""
    return json.dumps(finite_json(obj), indent=2, ensure_ascii=False, allow_nan=False,
                      default=lambda o: o.isoformat() if hasattr(o, "isoformat") else str(o))


NON_FINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def finite_json(obj):
    """obj with every non-finite float replaced by its JSON string (NON_FINITE); lists and dicts copied."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else NON_FINITE[str(obj)]
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj
