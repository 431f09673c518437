"""`python -m backend gc`: remove what finished runs left behind and nothing else; `delete_run`: a run and its folders.

- run folders (`<runs dir>/<id>`, also the SLURM run_dir) whose experiment was deleted, or whose stamp names
  another run (backend/run_folders), and folders set aside as `<id>.stale-<ms>`. Only in a runs dir this store owns
  (`owned_runs_dirs`): elsewhere (the SLURM run_dir, a server store's default <repo>/data/runs) other stores' runs
  live too, whose ids and uids this store cannot judge, so there only set-aside folders go;
- in the temp folder: per-job temp folders (`shardlab-job-<id>-*`, the worker's TMPDIR for a job) and dashboard
  trace folders (`shardlab-trace-<id>-*`) of experiments no longer running, and torchrun's `torchelastic_*`
  log folders (left by every run launched outside the worker).
Nothing that a live process still uses is touched: an experiment that is running keeps its folders, and a
temp folder named in any live process's TMPDIR / TORCHELASTIC_ERROR_FILE is kept. Temp folders must also be
older than `older_than_s` (default 1 h), so a run starting right now is never raced.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from backend import run_folders
from backend.result import Status
from backend.worker.recovery import JOB_TMP_PREFIX

TRACE_TMP_PREFIX = "shardlab-trace-"
_RUN_DIR = re.compile(r"(\d+)(\.stale-\d+)?")
_TMP_DIR = re.compile(rf"(?:{JOB_TMP_PREFIX}|{TRACE_TMP_PREFIX})(\d+)-")


@dataclass
class GcReport:
    removed: list[dict] = field(default_factory=list)
    """{"path", "bytes", "why"} per folder removed (or that would be, with dry_run)."""
    kept_in_use: int = 0
    dry_run: bool = False

    @property
    def bytes(self) -> int:
        return sum(r["bytes"] for r in self.removed)


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _paths_in_use() -> set[str]:
    """Folders live processes name in TMPDIR or TORCHELASTIC_ERROR_FILE (and every parent of those)."""
    used: set[str] = set()
    for p in psutil.process_iter():
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        for key in ("TMPDIR", "TORCHELASTIC_ERROR_FILE"):
            if env.get(key):
                path = Path(env[key])
                used.update(str(parent) for parent in (path, *path.parents))
    return used


def run_folder_verdict(folder: Path, uids: dict[int, str], running: set[int], owned: bool = True) -> str | None:
    """Why a folder under a runs dir is garbage (None: keep it); owned: the runs dir is this store's alone."""
    m = _RUN_DIR.fullmatch(folder.name)
    if m is None or not folder.is_dir():
        return None
    eid, stale = int(m.group(1)), m.group(2)
    if stale:
        return "set aside: another run's leftovers found under this run's id"
    if eid in running or not owned:
        return None
    if eid not in uids:
        return "its experiment was deleted"
    bound = run_folders.read_stamp(folder).get("run_uid")
    if bound is not None and bound != uids[eid]:
        return "stamped for another run with the same id"
    return None


def owned_runs_dirs(engine, runs_dir: Path | None = None) -> set[Path]:
    """The runs dirs only this store writes into: the one given by hand (--runs-dir), else the one beside its SQLite
    file; none for a server store, whose default (<repo>/data/runs) the checkout's own SQLite store uses too."""
    from db.session import sqlite_path

    if runs_dir is not None:
        return {Path(runs_dir).resolve()}
    if sqlite_path(str(engine.url.render_as_string(hide_password=False))) is None:
        return set()
    from backend.run_folders import default_runs_dir

    return {default_runs_dir(engine).resolve()}


def collect(engine, runs_dirs: list[Path], *, owned: set[Path] | None = None, tmp_dir: Path | None = None,
            older_than_s: float = 3600.0, dry_run: bool = False) -> GcReport:
    """What gc removes (module docstring); owned: the runs dirs this store owns (default `owned_runs_dirs`)."""
    from db import queries as q

    report = GcReport(dry_run=dry_run)
    uids = q.run_uids(engine)
    running = {r["id"] for r in q.list_experiments(engine, status=str(Status.RUNNING), columns=["id"])}
    owned = owned_runs_dirs(engine) if owned is None else {Path(d).resolve() for d in owned}
    candidates: list[tuple[Path, str]] = []
    for runs_dir in dict.fromkeys(Path(d).resolve() for d in runs_dirs):
        if runs_dir.is_dir():
            candidates += [(f, why) for f in sorted(runs_dir.iterdir())
                           if (why := run_folder_verdict(f, uids, running, runs_dir in owned))]
    tmp = Path(tmp_dir or tempfile.gettempdir())
    cutoff = time.time() - older_than_s
    in_use = _paths_in_use()
    for folder in sorted(tmp.iterdir()) if tmp.is_dir() else []:
        why = _tmp_verdict(folder, running)
        if why is None:
            continue
        try:
            old = folder.stat().st_mtime < cutoff
        except OSError:
            continue
        if str(folder) in in_use or not old:
            report.kept_in_use += 1
            continue
        candidates.append((folder, why))
    for folder, why in candidates:
        report.removed.append({"path": str(folder), "bytes": _size(folder), "why": why})
        if not dry_run:
            shutil.rmtree(folder, ignore_errors=True)
    return report


def _tmp_verdict(folder: Path, running: set[int]) -> str | None:
    if not folder.is_dir() or folder.is_symlink():
        return None
    if folder.name.startswith("torchelastic_"):
        return "torchrun log folder of a finished job"
    m = _TMP_DIR.match(folder.name)
    if m is None or int(m.group(1)) in running:
        return None
    return "temp folder of a finished run" if folder.name.startswith(JOB_TMP_PREFIX) else ("dashboard trace folder of "
                                                                                           "a finished trace")


def runs_dirs(engine, runs_dir: Path | None = None) -> list[Path]:
    """Where run folders live: the worker's runs dir and the SLURM config's run_dir (a broken cluster config must not
    stop a local delete or gc). The CLI's delete and gc and the dashboard's Delete use it."""
    from backend.run_folders import default_runs_dir

    dirs = [Path(runs_dir or default_runs_dir(engine))]
    try:
        from backend.cluster.slurm_config import load

        dirs.append(Path(load().run_dir))
    except Exception:  # noqa: BLE001
        pass
    return dirs


def delete_run(engine, experiment_id: int, runs_dirs: list[Path]) -> list[Path]:
    """Delete the experiment (db.queries.delete_experiment), then its folder in each runs dir (the worker's, the
    SLURM run_dir) when the folder's stamp names that run; returns the folders removed."""
    from db.queries import delete_experiment

    gone = delete_experiment(engine, experiment_id)
    folders: dict[Path, Path] = {}  # resolved -> as given: the same folder named twice is removed once
    for runs_dir in runs_dirs:
        folders.setdefault(Path(runs_dir).resolve(), Path(runs_dir) / str(experiment_id))
    return [f for f in folders.values() if run_folders.remove(f, gone["run_uid"])]
