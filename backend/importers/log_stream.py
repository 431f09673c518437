"""Read a training log as a stream of lines, in bounded memory, whatever its size or state.

- The file is read line by line in binary (at most MAX_LINE_BYTES per line: a longer "line" is a binary blob or
  a missing newline; it is skipped and counted), decoded as UTF-8 with replacement, ANSI colour codes removed
  (torchtitan colours its metrics).
- A rank prefix is split off: torchrun's `--tee` / `--local-ranks-filter` output "[default3]:" and "[rank3]:".
  DeepSpeed's own "[Rank 0] " sits inside the message and is read by its parser. With `LineStats.world` set (the
  config's GPUs), a prefix naming a rank outside it refuses the log at that line: the ranks kept (and the memory
  they take) are bounded by the world, never by what the log claims.
- A last line without its newline is what a killed or still-running job (or a cut file) leaves: it is not parsed,
  and the import says it is partial.
Nothing is kept but counters: the parsers keep what they need per step (a few numbers per logged step).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from backend.importers.import_result import LogImportError

MAX_LINE_BYTES = 64 * 1024
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
RANK_PREFIX = re.compile(r"^\[(?:default|rank)(\d{1,7})\]:\s?")


@dataclass
class LineStats:
    lines: int = 0
    bytes: int = 0
    overlong: int = 0
    """Lines over MAX_LINE_BYTES, skipped."""
    truncated_last_line: bool = False
    """The file ends inside a line (no final newline): that line was not parsed."""
    ranks_prefixed: set[int] = field(default_factory=set)
    world: int | None = None
    """The config's GPUs: a rank prefix outside 0..world-1 raises LogImportError."""

    def to_dict(self) -> dict[str, object]:
        return {"lines": self.lines, "bytes": self.bytes, "overlong_lines_skipped": self.overlong,
                "truncated_last_line": self.truncated_last_line, "rank_prefixes": sorted(self.ranks_prefixed)}


class Line(NamedTuple):  # a tuple: a 100 MB log makes a million of them
    number: int
    rank: int | None
    """From a "[defaultN]:" / "[rankN]:" prefix; None without one."""
    text: str


def read_lines(path: str | Path, stats: LineStats) -> Iterator[Line]:
    """Every complete line of the file (prefix split, colours removed), counting into `stats`."""
    with Path(path).open("rb") as f:
        number = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            number += 1
            stats.lines += 1
            stats.bytes += len(raw)
            if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                stats.overlong += 1
                _skip_rest_of_line(f, stats)
                continue
            if not raw.endswith(b"\n"):
                stats.truncated_last_line = True
                return
            yield split_line(number, raw.decode("utf-8", "replace").rstrip("\r\n"), stats)


def _skip_rest_of_line(f, stats: LineStats) -> None:
    while True:
        chunk = f.readline(MAX_LINE_BYTES)
        stats.bytes += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return


def split_line(number: int, text: str, stats: LineStats | None = None) -> Line:
    if "\x1b" in text:
        text = ANSI.sub("", text)
    rank = None
    if text.startswith("[") and (m := RANK_PREFIX.match(text)):
        rank = int(m.group(1))
        if stats is not None and stats.world is not None and rank >= stats.world:
            raise LogImportError([rank_outside(rank, stats.world, number, f"the prefix {m.group(0).strip()!r}")])
        text = text[m.end():]
        if stats is not None:
            stats.ranks_prefixed.add(rank)
    return Line(number, rank, text)


def rank_outside(rank: int, world: int, line: int, where: str) -> str:
    """Why a log naming `rank` is refused for a config of `world` GPUs."""
    return (f"line {line}: {where} names rank {rank}, outside the config's {world} GPUs (ranks 0..{world - 1}): is "
            "this the log of this config's run? Nothing stored")
