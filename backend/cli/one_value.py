"""Flags that set one field under two names (`--async-tp` and `--[no-]tp-comm-overlap`, `--nodes` and `--nnodes`):
each flag records the value it set and its name; another flag of the field setting another value is a usage error
naming both, instead of the last one silently winning. The same flag given twice is an override (last wins), as
argparse does for any flag."""

from __future__ import annotations

import argparse
from typing import Any

SET_BY = "_one_value_set_by"
"""The namespace attribute holding {dest: {action: (value, flag)}}: the last value each flag of a field set."""


def _record(action: argparse.Action, namespace: argparse.Namespace, flag: str | None) -> None:
    set_by: dict[str, dict[argparse.Action, tuple[Any, str | None]]] = getattr(namespace, SET_BY, None) or {}
    value = getattr(namespace, action.dest)
    for other, (before, other_flag) in set_by.get(action.dest, {}).items():
        if other is not action and before != value:
            raise argparse.ArgumentError(action, f"contradicts {other_flag} (both set "
                                                 f"{action.dest.removeprefix('spec_')}: {_word(before)}, then "
                                                 f"{_word(value)}); give one")
    set_by.setdefault(action.dest, {})[action] = (value, flag)
    setattr(namespace, SET_BY, set_by)


def _word(value: Any) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


class OneValueStore(argparse.Action):
    """`store`, refusing another flag of the same field with another value."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        _record(self, namespace, option_string)


class OneValueConst(argparse.Action):
    """`store_const` (a switch: nargs 0), refusing another flag of the same field with another value."""

    def __init__(self, option_strings: list[str], dest: str, const: Any = True, **kw: Any):
        super().__init__(option_strings, dest, nargs=0, const=const, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, self.const)
        _record(self, namespace, option_string)


class OneValueToggle(argparse.BooleanOptionalAction):
    """`--x / --no-x`, refusing another flag of the same field with another value."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        _record(self, namespace, option_string)
