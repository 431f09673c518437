"""Where each rank was when a job timed out, from the stack dumps the ranks write on STACK_SIGNAL
(backend/runtime/protocol.py: `enable_stack_dump`, `read_stacks`).

On timeout the launcher sends the signal to the job's rank processes (`Job.dump_stacks`), waits a moment, then
ends the job. `hang_report` reads the dumps and each rank's progress file (`rank-<r>.progress`: steps finished).
The rank holding the job up, the first of these that names exactly one: the rank whose innermost frame is outside
torch (e.g. sleeping in our own code) while its peers sit inside torch (blocked in a collective); the rank that did
not answer the stack-dump signal at all while its peers did (stopped by SIGSTOP or a debugger, stuck in the kernel,
swapped out: its peers wait for it in a collective); the rank that finished fewer steps than every peer.
"""

from __future__ import annotations

from pathlib import Path

from backend.runtime.protocol import RankProgress, RankStack, read_progress_marks, read_stacks, stack_dump_ranks


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
    if not stacks:  # nobody answered (or nobody was asked: the one-process JAX program is not signalled)
        return None
    marks = read_progress_marks(out_dir)
    answered = {s.rank for s in stacks}
    silent = [r for r in stack_dump_ranks(out_dir) if r not in answered and not (r in marks and marks[r].finished)]
    outside = [s for s in stacks if not in_torch(s)]
    waiting = [s for s in stacks if in_torch(s)]
    culprit, why = None, ""
    if len(outside) == 1 and waiting:
        culprit, why = outside[0].rank, "outside torch while its peers wait inside it"
    elif len(silent) == 1:
        culprit, why = silent[0], "did not answer the stack-dump signal (stopped, or stuck in the kernel)"
    elif (behind := _behind(marks)) is not None:
        culprit, why = behind, "stopped making progress first"
    parts = [f"rank {s.rank} {where(s)}" for s in (outside + waiting)] + [f"rank {r} gave no stack" for r in silent]
    lead = f"rank {culprit} is holding the job up ({why}); " if culprit is not None else ""
    return f"{lead}stacks at the timeout: " + "; ".join(parts) + _progress_text(marks), culprit


def _behind(marks: dict[int, RankProgress]) -> int | None:
    """The one rank that finished fewer steps than all its peers, if there is exactly one."""
    live = [m for m in marks.values() if not m.finished]
    if len(marks) < 2 or not live:
        return None
    least = min(m.steps_done for m in live)
    at_least = [m.rank for m in live if m.steps_done == least]
    return at_least[0] if len(at_least) == 1 and any(m.steps_done > least for m in marks.values()) else None


def _progress_text(marks: dict[int, RankProgress]) -> str:
    if not marks:
        return ""
    return "; steps finished: " + ", ".join(f"rank {m.rank} {m.steps_done} ({m.last})" for m in
                                             sorted(marks.values(), key=lambda m: m.rank))
