"""`python -m backend <command>`: the scriptable twin of the dashboard.

Each command lives in its own module exposing `register(subparsers)`; the handler it sets as
`func` returns the process exit code. Bad flags exit 2 with the reason on stderr. A reader that stops early
(`show 1 | head`) ends the command quietly with 141, as a program killed by SIGPIPE would.

Commands that only read or queue (submit, list, show, export, estimate, ...) never import torch (~3 s and ~275 MB):
tests/multiprocess/test_cli_process.py checks it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE: what a shell reports for a program that a closed pipe stopped."""

COMMANDS: dict[str, str] = {
    "estimate": "estimate", "run": "run", "submit": "submit", "list": "runs", "show": "runs", "cancel": "runs",
    "requeue": "runs", "delete": "runs", "tag": "runs", "export": "export", "worker": "worker", "gc": "worker",
    "trace": "trace", "hardware": "hardware", "plan": "plan", "calibrate": "calibrate", "ingest": "ingest",
    "import-config": "import_config", "import-run": "import_run",
}
"""Each command and the module under backend/cli that registers it: a command's own module is the only one imported
to run it (importing all of them costs about a second of CPU per call); `--help` and unknown commands import all."""

COMMAND_MODULES = tuple(dict.fromkeys(COMMANDS.values()))


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every command, or with `command` only when it is a known command (faster to build)."""
    parser = argparse.ArgumentParser(prog="python -m backend",
                                     description="ShardLab: measure and predict sharded training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in (COMMANDS[command],) if command in COMMANDS else COMMAND_MODULES:
        try:
            mod = importlib.import_module(f"backend.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"backend.cli.{name}":
                raise
            continue
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        argv = sys.argv[1:] if argv is None else argv
        args = build_parser(argv[0] if argv else None).parse_args(argv)
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
        return code
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """The reader of stdout closed it: point stdout at /dev/null, so the flush at exit has nowhere to fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (a test's captured stdout)
        pass
    finally:
        os.close(devnull)
    return EXIT_BROKEN_PIPE


def fail(message: str) -> int:
    """Print a usage error to stderr and return exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    return 2
