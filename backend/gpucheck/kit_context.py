"""What every phase of the GPU check shares: where it writes, what the earlier phases found, and how it
reports progress (one flushed line per event on stdout, the same line appended to OUT/kit.log)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PHASES = ("env", "probe", "runs", "diag", "trace", "tests", "late_runs", "allocator", "power")
"""Priority order: what matters most comes first, so a budget that runs out costs the least."""
REPORT_FILE, SUMMARY_FILE, PROFILE_FILE, LOG_FILE = "report.json", "summary.md", "profile.json", "kit.log"
"""Everything the kit writes under --out (4 files: the device machine returns at most 8)."""


@dataclass
class KitContext:
    device: str
    """cuda or cpu."""
    nproc: int
    out: Path
    work: Path
    """Scratch folder for run directories and trace files (not under out: only the report files come back)."""
    check_id: str
    run_names: list[str] | None = None
    python: str = sys.executable
    device_name: str = ""
    device_bytes: float | None = None
    datasheet_key: str | None = None
    profile_key: str | None = None
    profile_path: Path | None = None
    report: dict[str, Any] = field(default_factory=dict)
    save: Callable[[], None] = lambda: None
    """Rewrites report.json and summary.md (phases call it after each run so a timeout still leaves data)."""
    started: float = field(default_factory=time.monotonic)

    def progress(self, line: str, *, quiet: bool = False) -> None:
        """A progress line: on stdout unless quiet (per-step events go to the log file only)."""
        stamped = f"[gpu_check {time.monotonic() - self.started:6.1f}s] {line}"
        if not quiet:
            print(stamped, flush=True)
        try:
            with open(self.out / LOG_FILE, "a") as f:
                f.write(stamped + "\n")
        except OSError:
            pass
