"""`python -m backend ingest DIR`: the GPU check's runs (DIR/report.json, `runs`) stored as ordinary measured runs.

Each ok/failed run becomes an `experiments` row (kind "measured", through the same `store_result` as a worker's
run), tagged `gpu:<device name>` (the GPU it ran on: the Runs page's tags column; `cpu:<name>` for the CPU kit),
`gpu-check` and
`gpu-check:<check id>:<run>`; its result JSON keeps the check's `step_time`, `memory_fit` and `gpu_check` blocks
and the env with the device name (Run detail). Idempotent: a run whose `gpu-check:<check id>:<run>` tag is already
stored is skipped, so ingesting the same folder twice stores nothing new.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from backend.result import RunResult, Status

REPORT = "report.json"


def read_report(folder: Path) -> dict[str, Any]:
    path = Path(folder) / REPORT
    if not path.is_file():
        raise ValueError(f"{folder} has no {REPORT} (the folder the GPU check wrote with --out)")
    try:
        report = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(report, dict) or not isinstance(report.get("kit"), dict) or "check_id" not in report["kit"]:
        raise ValueError(f"{path} is not a GPU check report (no kit.check_id)")
    return report


def device_tag(report: dict[str, Any], entry: dict[str, Any]) -> str:
    """`gpu:<device name>` for a CUDA run (e.g. `gpu:NVIDIA H200`), `cpu:<cpu name>` for the CPU kit's runs."""
    env = entry.get("env") or {}
    name = env.get("device_name") or ((report.get("env") or {}).get("torch") or {}).get("device_name") or "unknown"
    kind = env.get("device_type") or (report.get("kit") or {}).get("device")
    return f"{'gpu' if kind == 'cuda' else 'cpu'}:{name}"


def run_tag(check_id: str, run: str) -> str:
    return f"gpu-check:{check_id}:{run}"


def _insert_row(engine, result: RunResult) -> int:
    from db import result_rows as rr
    from db.models import Experiment, utcnow
    from db.queries import store_result
    from db.session import writer

    with writer(engine) as s, s.begin():  # running, never queued: no worker may claim it
        exp = Experiment(**rr.spec_columns(result.spec), status=str(Status.RUNNING), kind="measured",
                         cancel_requested=False, created_at=utcnow(), started_at=utcnow())
        s.add(exp)
        s.flush()
        experiment_id = exp.id
    store_result(engine, experiment_id, result)
    return experiment_id


def ingest_report(engine, report: dict[str, Any]) -> list[dict[str, Any]]:
    """Store each run of `report`; one row per run: {run, status, experiment_id, action: stored|already|skipped}."""
    from db.queries import list_experiments, set_tags

    check_id = report["kit"]["check_id"]
    out = []
    for entry in report.get("runs") or []:
        name = str((entry.get("gpu_check") or {}).get("run") or "?")
        if "spec" not in entry:  # not started (budget) or no valid spec: nothing was measured
            out.append({"run": name, "status": entry.get("status"), "experiment_id": None, "action": "skipped",
                        "reason": entry.get("error")})
            continue
        tag = run_tag(check_id, name)
        seen = list_experiments(engine, tag=tag, columns=["id"])
        if seen:
            out.append({"run": name, "status": entry.get("status"), "experiment_id": seen[0]["id"],
                        "action": "already"})
            continue
        result = RunResult.model_validate(entry)
        experiment_id = _insert_row(engine, result)
        set_tags(engine, experiment_id, [device_tag(report, entry), "gpu-check", tag])
        out.append({"run": name, "status": str(result.status), "experiment_id": experiment_id, "action": "stored"})
    return out
