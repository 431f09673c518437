"""`python -m backend <command>`: the scriptable twin of the dashboard.

Each command is one entry of COMMANDS (its name, help line and module) plus the function in its module that adds
its flags and sets its handler as `func`; the handler returns the process exit code. Bad flags exit 2 with the
reason on stderr. A reader that stops early (`show 1 | head`) ends the command quietly with 141, as a program killed
by SIGPIPE would.

Commands that only read or queue (submit, list, show, export, estimate, ...) never import torch (~3 s and ~275 MB):
tests/multiprocess/test_cli_process.py checks it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass

EXIT_BROKEN_PIPE = 141
"""128 + SIGPIPE: what a shell reports for a program that a closed pipe stopped."""


@dataclass(frozen=True)
class Command:
    """One `python -m backend` command: build_parser adds it from this entry alone."""

    name: str
    """What a person types: `python -m backend <name>`."""
    module: str
    """The module under backend/cli holding its flags and handler: the only command module imported to run it."""
    help: str
    """Its line in `python -m backend --help`; `{frameworks}` stands for the importers' labels ("torchtitan / ...")."""
    flags: str = "add_flags"
    """The module's function that adds the command's flags to its parser and sets its handler as `func`."""
    described: bool = False
    """Its module's docstring is its `--help` description, printed as written."""


COMMANDS: tuple[Command, ...] = (
    Command("estimate", "estimate", "predict per-rank memory and communication (no torch run)", described=True),
    Command("run", "run", "run one experiment on real ranks and compare with the prediction", described=True),
    Command("submit", "submit", "queue an experiment (or a sweep) for the worker"),
    Command("list", "runs", "list experiments, newest first", flags="add_list_flags"),
    Command("show", "runs", "one experiment with its spec and result", flags="add_show_flags"),
    Command("cancel", "runs", "cancel a queued or running experiment", flags="add_cancel_flags"),
    Command("requeue", "runs", "queue a finished experiment again (as a new row)", flags="add_requeue_flags"),
    Command("delete", "runs", "delete an experiment and its results", flags="add_delete_flags"),
    Command("tag", "runs", "replace an experiment's tags", flags="add_tag_flags"),
    Command("export", "export", "export experiments as CSV or JSON"),
    Command("worker", "worker", "run queued experiments one at a time", flags="add_worker_flags"),
    Command("gc", "worker", "remove folders finished or deleted runs left behind (run folders, temp folders)",
            flags="add_gc_flags"),
    Command("trace", "trace", "trace per-rank memory at full size on fake tensors (no allocation)", described=True),
    Command("hardware", "hardware", "list hardware profiles for step-time prediction", described=True),
    Command("plan", "plan", "search parallel layouts and rank them by predicted step time", described=True),
    Command("published", "published", "the model against published training runs, per stack and GPU", described=True),
    Command("calibrate", "calibrate", "fit step-time parameters to stored runs", described=True),
    Command("ingest", "ingest", "store a GPU check's runs (its --out folder) as results", described=True),
    Command("import-config", "import_config", "turn a {frameworks} config into a spec", described=True),
    Command("import-run", "import_run", "store a {frameworks} run from its config and log", described=True),
)
"""Every command, in `--help` order: the only place a command is named (no module under backend/cli calls
add_parser). A call imports its own command's module only (importing all of them costs about a second of CPU);
`--help` and unknown commands import all."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every command, or with `command` only when it is a known command (faster to build)."""
    parser = argparse.ArgumentParser(prog="python -m backend",
                                     description="ShardLab: measure and predict sharded training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for entry in [c for c in COMMANDS if c.name == command] or COMMANDS:
        add_command(sub, entry)
    return parser


def add_command(sub: argparse._SubParsersAction, entry: Command) -> None:
    """Add `entry`'s parser to `sub`, its flags and handler from its module (skipped if the module is absent)."""
    try:
        mod = importlib.import_module(f"backend.cli.{entry.module}")
    except ModuleNotFoundError as e:
        if e.name != f"backend.cli.{entry.module}":
            raise
        return
    described = ({"description": mod.__doc__, "formatter_class": argparse.RawDescriptionHelpFormatter}
                 if entry.described else {})
    getattr(mod, entry.flags)(sub.add_parser(entry.name, help=help_line(entry), **described))


def help_line(entry: Command) -> str:
    """`entry.help` with `{frameworks}` filled in from the importer registry (imported only for such a line)."""
    if "{frameworks}" not in entry.help:
        return entry.help
    from backend.importers import registry

    return entry.help.format(frameworks=" / ".join(i.label for i in registry.IMPORTERS))


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
