"""Trace many (spec, rank) pairs in ONE process: `python -m backend.trace.batch --items ITEMS.json --out OUT.json`.

A traced rank pays ~10 s of process start-up and imports before its step; a grid of layouts
(benchmarks/fullest_moment.py, tests/multiprocess/test_fullest_moment.py) traces them one after the other in the same
process instead, leaving each fake world before the next (compat.leave_fake_pg). Each item's record is
`trace.rank.trace_rank`'s, or a failed one with its reason; the out file is rewritten after every item, so a timeout
keeps what was traced.

ITEMS.json: [{"spec": <ExperimentSpec JSON>, "rank": R}, ...]; OUT.json: the same order, one record per item.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from backend.atomic_io import write_json_atomic

ROOT = Path(__file__).resolve().parents[2]


def trace_items(items: list[dict[str, Any]], out: Path) -> list[dict[str, Any]]:
    """Trace each item in this process (the batch program's body)."""
    from backend.spec import ExperimentSpec
    from backend.trace.rank import trace_rank, unsupported_reason
    from backend.trace.torch_private import leave_fake_pg

    records: list[dict[str, Any]] = []
    for item in items:
        spec = ExperimentSpec.model_validate(item["spec"])
        t0 = time.perf_counter()
        try:
            record = trace_rank(spec, int(item["rank"]))
        except Exception as e:  # noqa: BLE001 - every failure is recorded with its item
            reason = unsupported_reason(e)
            record = {"rank": item["rank"], "status": "unsupported" if reason else "failed",
                      "error": reason or f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        finally:
            leave_fake_pg()
        record["spec"] = json.loads(spec.to_json())
        record["wall_s"] = time.perf_counter() - t0
        records.append(record)
        write_json_atomic(out, records)
    return records


def trace_many(items: list[dict[str, Any]], workdir: Path, timeout_s: float = 3600.0) -> list[dict[str, Any]]:
    """Run the batch program on `items` in one child process; its records (fewer than the items if it timed out or
    crashed: the missing ones come back as failed records naming why)."""
    workdir.mkdir(parents=True, exist_ok=True)
    src, out = workdir / "items.json", workdir / "records.json"
    src.write_text(json.dumps(items))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "backend.trace.batch", "--items", str(src), "--out", str(out)]
    why = None
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode:
            why = f"batch trace exited {proc.returncode}: {(proc.stderr or '')[-1500:]}"
    except subprocess.TimeoutExpired:
        why = f"batch trace exceeded {timeout_s:.0f} s"
    records = json.loads(out.read_text()) if out.exists() else []
    records += [{"rank": it["rank"], "status": "failed", "error": why or "not traced", "spec": it["spec"]}
                for it in items[len(records):]]
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.trace.batch")
    ap.add_argument("--items", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    records = trace_items(json.loads(args.items.read_text()), args.out)
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the fake PG and fake tensors need no teardown
