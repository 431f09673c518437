"""Soak (issue 21): N tiny runs through W real worker processes on a real PostgreSQL server that is stopped and
started again while they work, with one worker killed (SIGKILL) in the middle of a run. Every run must end ok,
or failed/interrupted with its reason; none lost (left queued/running), duplicated (started twice, or an extra
row) or mixed up (a result whose spec is another run's). Prints those counts as JSON.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/soak.py [--runs 200] [--workers 3] [--restarts 2] [--outage-s 20]

Runs are world-1 (and some world-2) tiny GPTs on the real launcher and engine; one in ten asks for CUDA and fails
in the launcher's preflight at once (a failed run with its reason, no process started). The server is stopped
when a third (and two thirds) of the runs are final; the worker is killed once half are. Needs the PostgreSQL
server binaries (tests/helpers/pg_server.py), as root or as a user that may run them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a file: the repository root, for its packages

from backend.result import FINISHED  # noqa: E402
from backend.spec import ExperimentSpec  # noqa: E402
from db import queries as q  # noqa: E402
from db.session import forget_engines, open_db  # noqa: E402

FINAL = {str(s) for s in FINISHED}
START_LINE = re.compile(r"experiment (\d+): \S+ world \d+ on ")


def tiny_spec(i: int) -> ExperimentSpec:
    world = 2 if i % 7 == 3 else 1
    runtime = {"device": "cuda", "backend": "nccl"} if i % 10 == 9 else {"device": "cpu"}
    return ExperimentSpec.model_validate({
        "name": f"soak-{i}", "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "seq_len": 8, "vocab_size": 32},
        "train": {"global_batch": 2 * world, "micro_batch": 2, "steps": 1, "warmup_steps": 0, "seed": i},
        "parallel": {"strategy": "ddp", "world_size": world}, "runtime": {**runtime, "timeout_s": 300}})


def start_worker(url: str, runs_dir: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "backend", "worker", "--db", url, "--runs-dir", str(runs_dir), "--poll-s", "0.2",
         "--heartbeat-s", "1", "--stale-after-s", "30", "--recover-every-s", "2", "--max-backoff-s", "2"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def final_count(engine) -> int | None:
    try:
        return sum(q.count_experiments(engine, status=s) for s in FINAL)
    except Exception:  # noqa: BLE001 - the server may be down right now
        return None


def busy_worker(engine, workers: list[subprocess.Popen]) -> subprocess.Popen | None:
    """A worker process that is running a job right now."""
    try:
        pids = {w["pid"] for w in q.worker_heartbeats(engine) if w["state"] == "running"}
    except Exception:  # noqa: BLE001
        return None
    return next((w for w in workers if w.pid in pids and w.poll() is None), None)


def soak(server, *, runs: int = 200, workers: int = 3, restarts: int = 2, outage_s: float = 20.0, kill: bool = True,
         workdir: Path | None = None, timeout_s: float = 3600.0, say=print) -> dict:
    """Run the soak against a started tests.pg_server.PgServer; returns the counts (and the events)."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="shardlab-soak-"))
    url = server.url(server.new_database())
    engine = open_db(url)
    specs = [tiny_spec(i) for i in range(runs)]
    ids = q.submit_experiments(engine, specs)
    logs = [workdir / f"worker-{i}.log" for i in range(workers)]
    procs = [start_worker(url, workdir / "runs", log) for log in logs]
    restart_at = [runs * (k + 1) // (restarts + 1) for k in range(restarts)]
    kill_at, killed, events = runs // 2 if kill else None, None, []
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        done = final_count(engine)
        if done is None:
            time.sleep(0.5)
            continue
        if done >= runs:
            break
        if all(p.poll() is not None for p in procs):
            say(f"[{time.monotonic() - t0:6.1f} s] every worker has exited; {done}/{runs} final")
            break
        if restart_at and done >= restart_at[0]:
            restart_at.pop(0)
            say(f"[{time.monotonic() - t0:6.1f} s] {done}/{runs} final: stopping PostgreSQL for {outage_s:g} s")
            server.pause()
            time.sleep(outage_s)
            server.resume()
            events.append({"event": "restart", "at_final": done, "outage_s": outage_s})
        if kill_at is not None and killed is None and done >= kill_at and (victim := busy_worker(engine, procs)):
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            killed = victim.pid
            say(f"[{time.monotonic() - t0:6.1f} s] {done}/{runs} final: killed worker pid {killed} mid-run")
            events.append({"event": "kill", "at_final": done, "pid": killed})
        time.sleep(0.5)
    wall_s = time.monotonic() - t0
    exit_codes = []
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        try:
            exit_codes.append(p.wait(60))
        except subprocess.TimeoutExpired:
            p.kill()
            exit_codes.append("hung")
    counts = check(engine, ids, specs, logs)
    counts.update(wall_s=round(wall_s, 1), events=events, worker_exit_codes=exit_codes, killed_pid=killed,
                  restarts_done=sum(e["event"] == "restart" for e in events), workdir=str(workdir))
    forget_engines()
    return counts


def check(engine, ids: list[int], specs: list[ExperimentSpec], logs: list[Path]) -> dict:
    """Counts: statuses, failed without a reason, lost, duplicated, mixed up."""
    starts = Counter(int(m.group(1)) for log in logs for m in START_LINE.finditer(log.read_text(errors="replace")))
    rows = {r["id"]: r for r in q.list_experiments(engine)}
    status, lost, no_reason, mixed, examples = Counter(), [], [], [], {}
    for eid, spec in zip(ids, specs, strict=False):
        row = rows.get(eid)
        if row is None or row["status"] not in FINAL:
            lost.append(eid)
            continue
        status[row["status"]] += 1
        full = q.get_experiment(engine, eid)
        if row["status"] != "ok" and not (row["error"] or "").strip():
            no_reason.append(eid)
        if row["status"] != "ok":
            examples.setdefault(row["status"], f"#{eid}: {row['error'][:160]}")
        result = full["result"]
        if full["spec"] != spec or (result is not None and result.spec != spec) or \
                (row["status"] == "ok" and len(result.per_rank) != spec.parallel.world_size):
            mixed.append(eid)
    duplicated = sorted({e for e, n in starts.items() if n > 1} | (set(rows) - set(ids)))
    return {"runs": len(ids), "ok": status.get("ok", 0),
            "not_ok_with_reason": sum(status.values()) - status.get("ok", 0) - len(no_reason),
            "by_status": dict(status), "without_reason": no_reason, "lost": lost,
            "duplicated": duplicated, "mixed_up": mixed, "examples": examples}


def main() -> int:
    from tests.helpers.pg_server import PgServer, unavailable_reason

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--restarts", type=int, default=2)
    ap.add_argument("--outage-s", type=float, default=20.0)
    ap.add_argument("--no-kill", action="store_true")
    args = ap.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"cannot soak: {reason}", file=sys.stderr)
        return 2
    server = PgServer().start()
    try:
        server.make_template()
        counts = soak(server, runs=args.runs, workers=args.workers, restarts=args.restarts, outage_s=args.outage_s,
                      kill=not args.no_kill)
    finally:
        server.stop()
    print(json.dumps(counts, indent=1))
    healthy = not (counts["lost"] or counts["duplicated"] or counts["mixed_up"] or counts["without_reason"])
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
