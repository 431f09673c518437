"""`python -m backend <command>`: the scriptable twin of the dashboard.

Each command lives in its own module exposing `register(subparsers)`; the handler it sets as
`func` returns the process exit code. Bad flags exit 2 with the reason on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = ("estimate", "run", "store", "trace", "hardware", "plan", "calibrate", "ingest", "import_config",
                   "import_run")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m backend", description="ShardLab: measure and predict sharded training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            mod = importlib.import_module(f"backend.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"backend.cli.{name}":
                raise
            continue
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


def fail(message: str) -> int:
    """Print a usage error to stderr and return exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2
