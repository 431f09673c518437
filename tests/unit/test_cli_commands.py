"""The CLI's command table (backend.cli.COMMANDS) is the only place a command is named: the parser is built from it,
no command module adds a parser of its own, and a call imports only its command's module."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import backend.cli
from backend.cli import COMMANDS, Command, build_parser, main

CLI_DIR = Path(backend.cli.__file__).parent


def subcommands(parser: argparse.ArgumentParser) -> list[str]:
    return list(next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices)


def calls_in(path: Path) -> set[str]:
    """Names of the attributes called anywhere in `path` (`p.set_defaults(...)` -> "set_defaults")."""
    return {n.func.attr for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}


def test_the_full_parser_has_exactly_the_tables_commands() -> None:
    names = [c.name for c in COMMANDS]
    assert len(set(names)) == len(names)
    assert subcommands(build_parser()) == names


def test_no_module_but_the_table_adds_a_command() -> None:
    """A command missing from the table cannot exist: only backend/cli/__init__.py calls add_parser, once, for an
    entry of COMMANDS; and every module that sets a handler is named by the table."""
    modules = sorted(CLI_DIR.glob("*.py"))
    adders = [p.name for p in modules if {"add_parser", "add_subparsers"} & calls_in(p)]
    assert adders == ["__init__.py"]
    assert (CLI_DIR / "__init__.py").read_text().count("add_parser(") == 1
    handlers = {p.stem for p in modules if "set_defaults" in calls_in(p)}
    assert handlers == {c.module for c in COMMANDS}


@pytest.mark.parametrize("entry", COMMANDS, ids=lambda c: c.name)
def test_an_entrys_flags_function_sets_its_handler(entry: Command) -> None:
    mod = importlib.import_module(f"backend.cli.{entry.module}")
    parser = argparse.ArgumentParser()
    getattr(mod, entry.flags)(parser)
    assert callable(parser.get_default("func"))
    assert not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)
    assert subcommands(build_parser(entry.name)) == [entry.name]


def test_a_new_command_is_one_entry_and_its_module(monkeypatch, capsys) -> None:
    fake = types.ModuleType("backend.cli.fake_command", "`fake`: a throw-away command.\n\n  keep   this layout\n")

    def add_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--times", type=int, default=1)
        p.set_defaults(func=lambda args: print("fake " * args.times) or 3)

    fake.add_flags = add_flags
    monkeypatch.setitem(sys.modules, "backend.cli.fake_command", fake)
    monkeypatch.setattr(backend.cli, "COMMANDS",
                        (*COMMANDS, Command("fake", "fake_command", "a throw-away command", described=True)))
    assert main(["fake", "--times", "2"]) == 3
    assert capsys.readouterr().out == "fake fake \n"
    with pytest.raises(SystemExit):
        main(["--help"])
    assert re.search(r"\n    fake +a throw-away command\n", capsys.readouterr().out)
    with pytest.raises(SystemExit):
        main(["fake", "--help"])
    assert "  keep   this layout" in capsys.readouterr().out  # the module's docstring, as written

    monkeypatch.undo()
    assert "fake" not in subcommands(build_parser())


def test_a_command_imports_only_its_own_module() -> None:
    code = ("import sys; from backend.cli import build_parser; build_parser('list'); "
            "print(' '.join(m for m in sys.modules if m.startswith(('backend.cli.', 'backend.importers'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    command_modules = {m.removeprefix("backend.cli.") for m in out.split()} & {c.module for c in COMMANDS}
    assert command_modules == {"runs"}, out
    assert "backend.importers" not in out  # only a `{frameworks}` help line needs the importer registry
