"""Where each rank was when a job timed out: Python stacks dumped by `faulthandler` on SIGUSR1.

Every rank registers `enable_stack_dump(out_dir, rank)` at start-up; on timeout the launcher sends SIGUSR1 to
the job's rank processes (`Job.dump_stacks`), waits a moment, then ends the job. `hang_report` reads the
dumps: a rank whose innermost frame is outside torch (e.g. sleeping in our own code) while its peers sit
inside torch (blocked in a collective) is the one holding the job up.
"""

from __future__ import annotations

import faulthandler
import re
import signal
from dataclasses import dataclass
from pathlib import Path

STACK_SIGNAL = signal.SIGUSR1
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
_KEEP: list = []  # the dump files stay open for the process lifetime (faulthandler writes to the fd)


def stack_path(out_dir: Path, rank: int) -> Path:
    return Path(out_dir) / f"rank-{rank}.stack.txt"


def enable_stack_dump(out_dir: Path, rank: int) -> None:
    """Dump every thread's Python stack to rank-<r>.stack.txt when this process gets SIGUSR1."""
    fh = open(stack_path(out_dir, rank), "w", encoding="utf-8")  # noqa: SIM115 - must outlive this call
    _KEEP.append(fh)
    faulthandler.register(STACK_SIGNAL, file=fh, all_threads=True, chain=False)


@dataclass
class RankStack:
    rank: int
    frames: list[tuple[str, int, str]]
    """Innermost first: (file, line, function) of the thread running our code."""

    @property
    def in_torch(self) -> bool:
        return bool(self.frames) and _is_torch(self.frames[0][0])

    def where(self) -> str:
        if not self.frames:
            return "no Python frame"
        ours = next((f for f in self.frames if "/backend/" in f[0] or "/tests/" in f[0]), self.frames[0])
        inner = self.frames[0]
        at = f"{_short(ours[0])}:{ours[1]} in {ours[2]}"
        return f"inside torch ({inner[2]}) called from {at}" if self.in_torch else f"outside torch at {at}"


def _is_torch(path: str) -> bool:
    return "-packages/torch/" in path  # site-packages or dist-packages


def _short(path: str) -> str:
    for marker in ("/backend/", "/tests/", "/site-packages/"):
        if marker in path:
            return path[path.index(marker) + 1:]
    return path


def parse_dump(text: str) -> list[list[tuple[str, int, str]]]:
    """Frames of each thread in a faulthandler dump (innermost first)."""
    threads: list[list[tuple[str, int, str]]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            threads.append([])
        elif threads and (m := _FRAME.match(line)):
            threads[-1].append((m["file"], int(m["line"]), m["func"]))
    return threads


def read_stacks(out_dir: Path) -> list[RankStack]:
    out = []
    for path in sorted(Path(out_dir).glob("rank-*.stack.txt")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            continue
        rank = int(path.name.split("-")[1].split(".")[0])
        threads = parse_dump(text)
        # the main thread runs the engine: the one whose outermost frames are our rank program
        main = next((t for t in threads if any("/backend/" in f[0] or "/tests/" in f[0] for f in t)), None)
        out.append(RankStack(rank, main or (threads[-1] if threads else [])))
    return sorted(out, key=lambda s: s.rank)


def hang_report(out_dir: Path) -> tuple[str, int | None] | None:
    """(one-line summary of where every rank was, the rank holding the job up if exactly one) or None."""
    stacks = read_stacks(out_dir)
    if not stacks:
        return None
    outside = [s for s in stacks if not s.in_torch]
    waiting = [s for s in stacks if s.in_torch]
    culprit = outside[0].rank if len(outside) == 1 and waiting else None
    parts = [f"rank {s.rank} {s.where()}" for s in (outside + waiting)]
    lead = f"rank {culprit} is holding the job up; " if culprit is not None else ""
    return f"{lead}stacks at the timeout: " + "; ".join(parts), culprit
