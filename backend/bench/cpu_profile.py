"""The "cpu" step-time profile on first need: the worker measures this host once, before its first local run, by
running `python -m backend.bench.hw_probe` in a child process (about 10 s; one at a time across workers, by a
file lock), so CPU runs get a step-time prediction without anyone knowing about the probe. Pages that need the
profile before any run say what to run (`MISSING`). `SHARDLAB_AUTO_HW_PROBE=0` turns the automatic probe off.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from backend.analytic.steptime.hardware import cpu_profile_path

AUTO_ENV = "SHARDLAB_AUTO_HW_PROBE"
PROBE_TIMEOUT_S = 300
PHASE = "measuring this host (once)"
MISSING = ("No 'cpu' step-time profile yet: the worker measures this host before its first local run, or run "
           "`python -m backend.bench.hw_probe` (about 10 s).")
REPO = Path(__file__).resolve().parents[2]


def exists() -> bool:
    return cpu_profile_path().exists()


def ensure(on_progress: Callable[[dict], None] | None = None) -> str | None:
    """Write the profile when it is missing (and automatic probing is on). Returns what happened, for the log, or None
    when there was nothing to do. Never raises: a failed probe only means no step-time prediction."""
    path = cpu_profile_path()
    if path.exists() or os.environ.get(AUTO_ENV, "1") == "0":
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # a second worker waits, then finds the profile written
            if path.exists():
                return None
            if on_progress:
                on_progress({"phase": PHASE})
            proc = subprocess.run([sys.executable, "-m", "backend.bench.hw_probe", "-o", str(path)], cwd=REPO,
                                  capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
    except (OSError, subprocess.SubprocessError) as e:
        return f"could not measure this host for the 'cpu' step-time profile: {e}"
    if proc.returncode != 0:
        return (f"hw_probe exited {proc.returncode}, no 'cpu' step-time profile: "
                f"{(proc.stderr or proc.stdout).strip()[-500:]}")
    return f"measured this host for the 'cpu' step-time profile: {proc.stdout.strip()}"
