"""A config's text parsed with bounds. json, tomllib and yaml.safe_load each recurse once per nesting level, so a
2 KB file nested 1,000 deep ends in a RecursionError. `parse_bounded` turns that into the reason, and refuses a parsed
value nested deeper than spec/user_text.MAX_JSON_DEPTH levels or holding more than fields.MAX_NODES values, as the
spec loader does for a --spec file or a config.json (spec/user_text.load_json_text)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from backend.importers.fields import check_nodes
from backend.importers.import_result import ConfigImportError
from backend.spec.user_text import MAX_JSON_DEPTH, check_depth


def parse_bounded(parse: Callable[[str], Any], text: str, what: str) -> Any:
    """`parse(text)`, refused with ConfigImportError when it nests too deep or expands too far. The parser's own
    errors pass through for the caller to word."""
    try:
        data = parse(text)
    except RecursionError:
        raise ConfigImportError([too_deep(what)]) from None
    try:
        check_nodes(data, what)
        check_depth(data, what)
    except ValueError as e:
        raise ConfigImportError([str(e)]) from None
    return data


def too_deep(what: str) -> str:
    return f"{what} nests too deep to parse: a config nests at most {MAX_JSON_DEPTH} levels"
