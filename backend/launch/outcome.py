"""Why a job did not succeed: status, first failing rank, its traceback and a one-line cause.

Sources, best first: the ranks' error records (`rank-<r>.error.json`, backend/runtime/protocol.py; ordered so
that the rank that failed on its own comes before peers that only saw it go away), then torchrun's failure summary
("Root Cause (first observed failure)": rank and exit code, e.g. -9 for SIGKILL).
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path

from backend.launch.stacks import hang_report
from backend.result import Status
from backend.runtime.protocol import RankError, read_rank_errors

# Errors a healthy rank raises when a peer dies: never the root cause while another rank has one.
_PEER_ERROR = re.compile(
    r"connection (closed|reset)|closed by peer|broken pipe|ECONNRESET|Connection refused|"
    r"NCCL communicator was aborted|ProcessGroup.*(abort|shut)",
    re.IGNORECASE,
)
_TIMEOUT_ERROR = re.compile(r"timed out|timeout", re.IGNORECASE)
_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
_ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)",
    re.DOTALL,
)


@dataclass
class Failure:
    status: Status
    error: str
    failing_rank: int | None = None
    traceback: str | None = None


def rank_errors(out_dir: Path) -> list[RankError]:
    """Every rank's error record, root cause first."""
    return sorted(read_rank_errors(out_dir), key=lambda r: (_is_peer_error(r), r.failed_at_unix))


def _is_peer_error(rec: RankError) -> bool:
    return bool(_PEER_ERROR.search(f"{rec.error}\n{rec.traceback or ''}"))


def torchrun_root_cause(log_text: str) -> tuple[int, int] | None:
    """(global rank, exit code) from torchrun's failure summary, if it printed one."""
    matches = _ROOT_CAUSE.findall(log_text)
    if not matches:
        return None
    rank, code = matches[-1]
    return int(rank), int(code)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def from_rank_errors(out_dir: Path) -> Failure | None:
    records = rank_errors(out_dir)
    if not records:
        return None
    first = records[0]
    rank = first.rank
    message = first.error.strip().splitlines()
    one_line = message[-1] if message else "unknown error"
    if first.kind == "oom":
        status = Status.OOM
    elif _TIMEOUT_ERROR.search(one_line):
        status = Status.TIMEOUT
    else:
        status = Status.FAILED
    return Failure(status, f"rank {rank}: {one_line}", rank, first.traceback)


def torchrun_failures(log_text: str) -> list[tuple[int, int]]:
    """Every (global rank, exit code) torchrun's failure summary lists ("Failures:" and "Root Cause")."""
    return [(int(r), int(c)) for r, c in _FAILURE.findall(log_text)]


def classify_exit(out_dir: Path, returncode: int, log_text: str) -> Failure:
    """A job that ended on its own with a non-zero exit code (or without a result)."""
    records = rank_errors(out_dir)
    own = from_rank_errors(out_dir)
    if own is not None and not _is_peer_error(records[0]):
        return own
    root = torchrun_root_cause(log_text)
    reported = {r.rank for r in records}
    if root is not None and root[0] in reported:
        # torchrun saw a peer's error exit first (load decides who exits first): a rank killed by a signal
        # without an error report of its own is the cause
        silent = [f for f in torchrun_failures(log_text)  # SIGTERM is torchrun ending the rest of the job
                  if f[0] not in reported and f[1] < 0 and f[1] != -signal.SIGTERM]
        root = silent[0] if silent else root
    if root is not None and root[0] not in reported:
        rank, code = root
        note = " (the kernel's OOM killer also sends SIGKILL)" if code == -signal.SIGKILL else ""
        seen = f"; then {own.error}" if own is not None else ""
        return Failure(Status.FAILED, f"rank {rank} {describe_exit(code)} without an error report{note}{seen}", rank)
    if own is not None:
        return own
    return Failure(Status.FAILED, f"torchrun {describe_exit(returncode)}; no rank reported an error (see log tail)")


def timed_out(out_dir: Path, timeout_s: float, wall_s: float, *, nccl: bool = False) -> Failure:
    base = f"job exceeded timeout_s={timeout_s:g} (ran {wall_s:.1f} s) and was killed"
    hang = hang_report(out_dir)
    if hang is not None:
        base, culprit = f"{base}; {hang[0]}", hang[1]
    else:
        culprit = None
    if nccl:  # a hung NCCL op does not block its host thread: the stacks show where each host waited later
        culprit = None
        base += "; " + _flight_recorder_hint(out_dir)
    failure = from_rank_errors(out_dir)
    if failure is None:
        return Failure(Status.TIMEOUT, base, culprit)
    return Failure(Status.TIMEOUT, f"{base}; first error: {failure.error}", failure.failing_rank, failure.traceback)


def _flight_recorder_hint(out_dir: Path) -> str:
    from backend.launch.nccl import TRACE_FILE_PREFIX

    dumps = sorted(p.name for p in Path(out_dir).glob(TRACE_FILE_PREFIX + "*"))
    if dumps:
        return (f"NCCL flight-recorder dumps in the run folder ({', '.join(dumps[:8])}): the culprit is the first "
                "collective (by sequence number) some rank never entered; the Python stacks only show where hosts "
                "waited")
    return ("nccl: the Python stacks show where hosts waited, not which collective hung, and NCCL's watchdog wrote no "
            "flight-recorder dump before the job was killed")
