"""Dashboard side of full-scale traced memory (backend/trace): start a trace from the New-experiment page,
and say on the run page / in run labels that a result was traced, not measured."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from backend.spec import ExperimentSpec

ROOT = Path(__file__).resolve().parents[1]
TRACED = "traced"


def start_trace(spec: ExperimentSpec, db_url: str) -> int:
    """Create the history row (kind traced, running) and trace in a detached `python -m backend trace`
    process, which stores the outcome in that row; returns the experiment id at once."""
    from backend.trace.history import begin_trace
    from db.session import open_db

    eid = begin_trace(open_db(db_url), spec)
    folder = Path(tempfile.mkdtemp(prefix=f"shardlab-trace-{eid}-"))
    (folder / "spec.json").write_text(spec.to_json())
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with open(folder / "log.txt", "w") as log:
        subprocess.Popen([sys.executable, "-m", "backend", "trace", "--spec", str(folder / "spec.json"),
                          "--experiment-id", str(eid), "--db", db_url, "--json"],
                         cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return eid


def is_traced(result: Any = None, row: dict[str, Any] | None = None) -> bool:
    if row is not None and row.get("kind") == TRACED:
        return True
    extra = getattr(result, "model_extra", None) or {}
    return extra.get("kind") == TRACED


def banner(result: Any) -> str | None:
    """The run page's line for a traced result (None for a measured run)."""
    if not is_traced(result):
        return None
    trace = (getattr(result, "model_extra", None) or {}).get("trace") or {}
    ranks = [r.get("rank") for r in trace.get("ranks", [])]
    return ("Traced at full size on fake tensors over the fake process group: the engine's own set-up and train "
            "step ran for ranks " + ", ".join(map(str, ranks)) + " without allocating; 'measured' below is the "
            "tracker's account of those fake tensors. No step time, loss or comm is measured by a trace.")
