"""Limits on what people type or upload: names, tags, notes, spec and config files.

One set of rules for every store (SQLite stores anything, PostgreSQL refuses NUL bytes and over-long
VARCHARs), applied before anything is stored or launched:
- user text (a name, a tag, a model source's file name) is plain text of bounded length, without control
  characters (C0/C1, DEL, line and paragraph separators, bidi overrides), which could fake table rows in a
  terminal or reorder what a reader sees;
- JSON read from a file (a --spec, a sweep grid, a config.json) is bounded in size and nesting depth, so a
  hostile file gives a clear error instead of a RecursionError or gigabytes of memory.
`printable` escapes such characters on output, for text stored before these rules existed.
"""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import Any

MAX_NAME_CHARS = 200
MAX_TAG_CHARS = 100
MAX_TAGS = 32
MAX_JSON_FILE_BYTES = 1 << 20
"""A spec, a sweep grid or a Hugging Face config.json is a few KB; 1 MiB leaves room and bounds parsing."""
MAX_JSON_DEPTH = 32
"""A spec nests 6 levels (spec > model > source > hf_config > rope_scaling > value)."""
MAX_SOURCE_BYTES = 32 * 1024
"""A model's `source` (a preset name, or the parsed fields of a config.json) stored with every run."""
_BIDI = {chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))}


def size_text(size: int) -> str:
    """A file's size for a person: '812 bytes', '4.96 MiB (5,200,000 bytes)'."""
    if size < 1024:
        return f"{size:,} bytes"
    value, unit = float(size), "B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):  # noqa: B007 - the unit reached is read after the loop
        value /= 1024
        if value < 1024:
            break
    return f"{value:.3g} {unit} ({size:,} bytes)"


def over_limit(what: str, size: int, limit: int) -> str:
    """'the TOML is 4.96 MiB (5,200,000 bytes), over the 1,048,576-byte limit (1 MiB)'."""
    return f"{what} is {size_text(size)}, over the {limit:,}-byte limit ({size_text(limit).split(' (')[0]})"


class InputError(ValueError):
    """User input refused before anything is stored or launched; the message says why, with the numbers."""


def _forbidden(ch: str) -> bool:
    return unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp") or ch in _BIDI


def text_problem(value: str, what: str, max_chars: int) -> str | None:
    """Why `value` cannot be stored as `what` (None when it can)."""
    if len(value) > max_chars:
        return f"{what} is {len(value):,} characters, over the {max_chars}-character limit"
    for i, ch in enumerate(value):
        if _forbidden(ch):
            return (f"{what} has the control character U+{ord(ch):04X} at position {i}: names, tags and notes are "
                    "plain text (no control characters, newlines or bidi overrides)")
    return None


def clean_tags(tags) -> list[str]:
    """Tags without empty strings and duplicates, in order; raises InputError listing every refused tag."""
    if isinstance(tags, str):
        tags = [tags]
    clean = list(dict.fromkeys(str(t) for t in tags if t))
    problems = [p for i, t in enumerate(clean) if (p := text_problem(t, f"tag {i + 1} ({printable(t)[:40]!s})",
                                                                     MAX_TAG_CHARS))]
    if len(clean) > MAX_TAGS:
        problems.append(f"{len(clean)} tags, over the limit of {MAX_TAGS} per run")
    if problems:
        raise InputError("; ".join(problems))
    return clean


def printable(text: Any) -> str:
    """`text` with every control character escaped (\\x1b, \\n, \\u202e): safe to print on one terminal line."""
    s = "" if text is None else str(text)
    if not any(_forbidden(ch) for ch in s):
        return s
    return "".join((f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}") if _forbidden(ch) else ch
                   for ch in s)


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)
        else:
            deepest = max(deepest, depth)
            continue
        deepest = max(deepest, depth + 1)
        if deepest > 10 * MAX_JSON_DEPTH:
            break  # deep enough to refuse; stop walking
    return deepest


def check_depth(value: Any, what: str, max_depth: int = MAX_JSON_DEPTH) -> None:
    depth = json_depth(value)
    if depth > max_depth:
        raise InputError(f"{what} nests {depth if depth <= 10 * max_depth else f'more than {10 * max_depth}'} levels "
                         f"deep, over the limit of {max_depth}")


def load_json_text(text: str | bytes, what: str, *, max_bytes: int = MAX_JSON_FILE_BYTES,
                   max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse JSON that a person supplied; InputError (never RecursionError / MemoryError) when it is too big,
    too deep or not JSON."""
    size = len(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    if size > max_bytes:
        raise InputError(over_limit(what, size, max_bytes))
    try:
        value = json.loads(text)
    except RecursionError:
        raise InputError(f"{what} nests too deep to parse (the limit is {max_depth} levels)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {what}: not valid JSON ({e})") from None
    check_depth(value, what, max_depth)
    return value


def load_json_file(path: Path | str, what: str, *, max_bytes: int = MAX_JSON_FILE_BYTES,
                   max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Read and parse a JSON file (size checked before reading it whole)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise InputError(over_limit(f"{what} {path}", size, max_bytes))
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e}") from None
    return load_json_text(data, f"{what} {path}", max_bytes=max_bytes, max_depth=max_depth)


def source_problem(source: dict[str, Any] | None) -> str | None:
    """Why a model `source` cannot be stored with a run: too big, too deep, or text with control characters."""
    if source is None:
        return None
    depth = json_depth(source)
    if depth > MAX_JSON_DEPTH:
        return f"model.source nests {depth} levels deep, over the limit of {MAX_JSON_DEPTH}"
    try:
        size = len(json.dumps(source, ensure_ascii=False).encode("utf-8"))
    except (TypeError, ValueError, UnicodeEncodeError) as e:
        return f"model.source is not plain JSON: {e}"
    if size > MAX_SOURCE_BYTES:
        return (over_limit("model.source", size, MAX_SOURCE_BYTES) + ": a run keeps the parsed "
                "fields of a config, not the whole file")
    for text in _strings(source):
        if problem := text_problem(text, "model.source text", MAX_SOURCE_BYTES):
            return problem
    return None


def _strings(value: Any):
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
