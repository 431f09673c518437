"""Where each rank was when a job timed out, from the stack dumps the ranks write on STACK_SIGNAL
(backend/runtime/protocol.py: `enable_stack_dump`, `read_stacks`).

On timeout the launcher sends the signal to the job's rank processes (`Job.dump_stacks`), waits a moment, then
ends the job. `hang_report` reads the dumps: a rank whose innermost frame is outside torch (e.g. sleeping in our
own code) while its peers sit inside torch (blocked in a collective) is the one holding the job up.
"""

from __future__ import annotations

from pathlib import Path

from backend.runtime.protocol import RankStack, read_stacks


def in_torch(stack: RankStack) -> bool:
    return bool(stack.frames) and _is_torch(stack.frames[0].file)


def where(stack: RankStack) -> str:
    if not stack.frames:
        return "no Python frame"
    ours = next((f for f in stack.frames if "/backend/" in f.file or "/tests/" in f.file), stack.frames[0])
    inner = stack.frames[0]
    at = f"{_short(ours.file)}:{ours.line} in {ours.function}"
    return f"inside torch ({inner.function}) called from {at}" if in_torch(stack) else f"outside torch at {at}"


def _is_torch(path: str) -> bool:
    return "-packages/torch/" in path  # site-packages or dist-packages


def _short(path: str) -> str:
    for marker in ("/backend/", "/tests/", "/site-packages/"):
        if marker in path:
            return path[path.index(marker) + 1:]
    return path


def hang_report(out_dir: Path) -> tuple[str, int | None] | None:
    """(one-line summary of where every rank was, the rank holding the job up if exactly one) or None."""
    stacks = read_stacks(out_dir)
    if not stacks:
        return None
    outside = [s for s in stacks if not in_torch(s)]
    waiting = [s for s in stacks if in_torch(s)]
    culprit = outside[0].rank if len(outside) == 1 and waiting else None
    parts = [f"rank {s.rank} {where(s)}" for s in (outside + waiting)]
    lead = f"rank {culprit} is holding the job up; " if culprit is not None else ""
    return f"{lead}stacks at the timeout: " + "; ".join(parts), culprit
