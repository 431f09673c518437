"""The CLI's command table (backend.cli.COMMANDS): each command names the module that registers it, so a call imports
only that module."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

from backend.cli import COMMANDS, build_parser


def registered_by(module: str) -> set[str]:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    importlib.import_module(f"backend.cli.{module}").register(sub)
    return set(sub.choices)


def test_every_command_is_registered_by_the_module_the_table_names() -> None:
    for module in set(COMMANDS.values()):
        assert registered_by(module) == {c for c, m in COMMANDS.items() if m == module}, module


def test_the_full_parser_has_exactly_the_tables_commands() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == list(COMMANDS)


def test_a_command_imports_only_its_own_module() -> None:
    code = ("import sys; from backend.cli import build_parser; build_parser('list'); "
            "print(' '.join(m for m in sys.modules if m.startswith('backend.cli.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    command_modules = {m.removeprefix("backend.cli.") for m in out.split()} & set(COMMANDS.values())
    assert command_modules == {"runs"}, out
