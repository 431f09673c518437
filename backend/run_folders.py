"""Run folders (`<runs dir>/<experiment id>`) bound to the run that owns them.

A folder name is an experiment id, and an id alone does not identify a run: a store can reuse a deleted row's
id (before revision 0007), and two stores can share one SLURM run_dir. So the worker stamps each folder it
starts a run in with `run.json` {"experiment_id", "run_uid"} (the row's revision-0007 uid; the SLURM runner
also writes it into slurm.json), and everything that trusts a folder checks the stamp first:
- a fresh run finding its folder already there sets the old one aside (`<id>.stale-<time>`: nothing is
  deleted, nothing of it can speak for the new run);
- a result.json on disk is imported only into the run whose uid it carries (`bound_result`);
- `delete` removes a run's folder only when the stamp names that run (backend/worker/cleanup.delete_run).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from backend.atomic_io import write_json_atomic
from backend.result import RunResult
from backend.spec import READ_BACK

log = logging.getLogger("shardlab.runs")
STAMP = "run.json"
STALE_MARK = ".stale-"


def default_runs_dir(engine) -> Path:
    """Beside the SQLite file (data/runs for the default data/shardlab.db), else <repo>/data/runs."""
    from db.session import REPO, sqlite_path

    path = sqlite_path(str(engine.url.render_as_string(hide_password=False)))
    return (path.parent if path else REPO / "data") / "runs"


def read_stamp(folder: Path) -> dict:
    """The folder's binding: run.json, else the run_uid a SLURM runner wrote into slurm.json ({} if neither)."""
    for name in (STAMP, "slurm.json"):
        try:
            data = json.loads((Path(folder) / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and data.get("run_uid"):
            return data
    return {}


def set_aside(folder: Path) -> Path | None:
    """Rename an existing folder to `<name>.stale-<epoch ms>` (kept for inspection; `gc` removes it later)."""
    folder = Path(folder)
    if not folder.exists():
        return None
    target = folder.with_name(f"{folder.name}{STALE_MARK}{int(time.time() * 1000)}")
    folder.rename(target)
    return target


def prepare(folder: Path, experiment_id: int, run_uid: str) -> Path | None:
    """Before a fresh run: set aside whatever is in the folder (another run's leftovers), create it, stamp it.
    Returns where an old folder went (None when there was none)."""
    folder = Path(folder)
    moved = None
    if folder.exists() and read_stamp(folder).get("run_uid") != run_uid:
        moved = set_aside(folder)
        log.warning("run folder %s held another run's files (stamp %s): set aside as %s",
                    folder, read_stamp(moved).get("run_uid") or "none", moved.name)
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / STAMP, {"experiment_id": int(experiment_id), "run_uid": run_uid})
    return moved


def bound_to(folder: Path, run_uid: str) -> bool:
    return read_stamp(folder).get("run_uid") == run_uid


def bound_result(folder: Path, run_uid: str) -> RunResult | None:
    """The folder's result.json when the folder is bound to run_uid and the file is a complete result."""
    path = Path(folder) / "result.json"
    if not path.exists() or not bound_to(folder, run_uid):
        return None
    try:
        return RunResult.model_validate_json(path.read_text(), context=READ_BACK)  # the worker's refusals too
    except (OSError, ValueError) as e:
        log.warning("result %s is unreadable (%s): not imported", path, e)
        return None


def remove(folder: Path, run_uid: str) -> bool:
    """Delete a run's folder if it is bound to run_uid (never another run's folder). True when removed."""
    folder = Path(folder)
    if not folder.is_dir() or not bound_to(folder, run_uid):
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return not folder.exists()
