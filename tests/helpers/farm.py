"""A session-wide farm of rank programs: every job the selected tests declare runs in as few launches as possible, one
torchrun launch per world size (one plain process for the trace jobs, one for the JAX runs, beside the torchrun
launches), and each job's outcome stays its own.

A test declares its jobs with a `farm` mark (`@uses(job, ...)`, or `params(jobs)` for a parametrized test) and reads
them with the `farm` fixture: `farm.result(job)` waits for that job and returns its value, or fails the test with the
job's own error, traceback and log tail. The session starts the farm before the first test (tests/conftest.py), in a
thread of one pytest process (under pytest-xdist: the worker that claims it first; the other reads the same folder),
and the launches overlap the other tests (`order_items` says in what order the files that read it come).

Inside a launch each rank runs the jobs in order (tests/helpers/farm_rank.py): the process group is made once per
launch, every job builds its own mesh (the engine's `run_rank`, as `python -m backend.engine.rank` does). A job that
raises on any rank writes that rank's error file and ends the launch; the driver records the failure for that job
(backend/launch/outcome.py picks the rank that failed first) and launches the jobs after it again. A job that runs
past its timeout is killed with its launch and recorded as timed out. Identical jobs run once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from backend.spec import ExperimentSpec
from tests.helpers.launch import ROOT, rank_env, torchrun_cmd

OUTCOME = "outcome.json"
HEARTBEAT_S = 2.0
DRIVER_GONE_S = 300.0  # no heartbeat for this long: the process running the farm is gone


TOL = 1e-4
"""Loss and parameter parity of a parity job with the single-process reference (fp32)."""


class JobFailed(AssertionError):
    """A farm job failed, timed out or never ran: its own error, traceback and log tail."""


@dataclass(frozen=True)
class Job:
    """One job: `kind` names its function in farm_rank.JOBS, `payload` its JSON input."""

    kind: str
    name: str
    world: int
    """torchrun ranks (--nproc-per-node), unless one_process."""
    payload: str
    timeout_s: float = 600.0
    one_process: bool = False
    """The job runs in one plain process without torchrun or process group (a trace; JAX's virtual devices)."""

    @property
    def group(self) -> str:
        """Jobs of one group share a launch: torchrun's world size, or a one-process job's kind and world (JAX fixes
        its virtual device count when it is imported)."""
        return f"{self.kind}-w{self.world}" if self.one_process else f"w{self.world}"

    @property
    def key(self) -> str:
        digest = hashlib.sha1(f"{self.kind}|{self.world}|{self.payload}".encode()).hexdigest()[:10]
        return f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', self.name)[:40]}-{digest}"


def engine_job(spec: ExperimentSpec, timeout_s: float = 600.0) -> Job:
    """The spec's whole rank program, as the launcher picks it (backend.engine.rank.run_rank; DeepSpeed's or JAX's by
    spec.framework): value {"result": RunResult (the framework's assembler), "ranks", "log": {rank: output}}."""
    jax = str(spec.framework) == "jax"  # the whole world in one process (N virtual devices)
    return Job("jax" if jax else "engine", _name(spec), spec.parallel.world_size, spec.to_json(), timeout_s,
               one_process=jax)


def parity_job(spec: ExperimentSpec, steps: int = 2, timeout_s: float = 300.0) -> Job:
    """prepare + `steps` train steps against the single-process reference (tests/helpers/mp_harness.py)."""
    return Job("parity", _name(spec), spec.parallel.world_size, json.dumps({"spec": spec.to_json(), "steps": steps}),
               timeout_s)


def fp16_inject_job(spec: ExperimentSpec) -> Job:
    """+inf in rank 1's gradient at step 1 (tests/helpers/fp16_inject.py)."""
    return Job("fp16_inject", _name(spec), spec.parallel.world_size, json.dumps({"spec": spec.to_json()}), 300.0)


def trace_job(spec: ExperimentSpec, ranks: list[int] | None = None) -> Job:
    """backend.trace.trace_spec(spec, ranks) with every rank traced in the farm's trace process (ranks None: the
    representative ones); value: trace_spec's JSON object."""
    return Job("trace", _name(spec), 0, json.dumps({"spec": spec.to_json(), "ranks": ranks}), 1800.0, one_process=True)


def _name(spec: ExperimentSpec) -> str:
    """The spec's name, else its layout in words (the job's name in messages; its key tells identical names apart)."""
    p = spec.parallel
    return spec.name or f"{spec.framework} {p.strategy} world {p.world_size} tp{p.tp} pp{p.pp} cp{p.cp} ep{p.ep}"


def program_job(kind: str, world: int, timeout_s: float = 300.0, **options: Any) -> Job:
    """A rank program of the tests' own (farm_rank.JOBS[kind]) with JSON options."""
    return Job(kind, kind, world, json.dumps(options, sort_keys=True), timeout_s)


def assert_parity(r: dict[str, Any], tol: float = TOL) -> None:
    """A parity job's losses and final parameters equal the single-process reference's within `tol`."""
    assert r["loss_max_abs_diff"] <= tol, (r["name"], r["loss"], r["loss_reference"])
    assert r["param_max_abs_diff"] <= tol, (r["name"], r["param_max_abs_diff"])
    assert r["params_compared"] > 0


def uses(*jobs: Job) -> pytest.MarkDecorator:
    """The farm mark: this test reads these jobs."""
    return pytest.mark.farm(*jobs)


def params(jobs: dict[str, Job]) -> list[Any]:
    """Parametrize by name, each case marked with its own job (a `-k` selection runs only what it reads)."""
    return [pytest.param(name, marks=uses(job), id=name) for name, job in jobs.items()]


def jobs_of(items: Iterable[pytest.Item]) -> list[Job]:
    """The distinct jobs the items' farm marks declare, in the farm's order: by launch group, first use first."""
    seen: dict[str, Job] = {}
    for item in items:
        for mark in item.iter_markers("farm"):
            for job in mark.args:
                seen.setdefault(job.key, job)
    order = list(dict.fromkeys(j.group for j in seen.values()))
    return sorted(seen.values(), key=lambda j: order.index(j.group))


class Farm:
    """The jobs' outcomes under `root`: `run()` produces them (the driver), `result(job)` waits for one."""

    def __init__(self, root: Path, jobs: list[Job]) -> None:
        self.root, self.jobs = root, jobs
        self.declared = {j.key for j in jobs}
        # the environment now: tests change os.environ while the farm's thread launches (SHARDLAB_FAULT, store URLs)
        self.env = {k: v for k, v in rank_env().items() if k != "SHARDLAB_FAULT"}
        self.thread: threading.Thread | None = None
        self.procs: set[subprocess.Popen] = set()
        """The launches running now (one per lane); added and removed under `_lock`, which stop() takes too."""
        self._lock = threading.RLock()
        """Held while a launch starts, so stop() either comes first (no launch) or finds the launch started. Reentrant:
        a stop() on the driver's own thread (a signal handler) must not wait for itself."""
        self._stopped = False

    # ---- the driver -------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Run the farm in a thread of this process when no other process has claimed it."""
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            (self.root / "driver").mkdir()
        except FileExistsError:
            return
        self._beat()
        self.thread = threading.Thread(target=self.run, name="farm", daemon=True)
        self.thread.start()

    def run(self) -> None:
        """Every group, in two lanes at once: the torchrun launches one after another, and beside them the
        one-process groups (a trace or JAX process uses one core; alone at the end of the farm it left the other
        idle while a test waited for it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        groups = list(dict.fromkeys(j.group for j in self.jobs))
        one_process = {j.group for j in self.jobs if j.one_process}
        beside = threading.Thread(target=self._run_lane, args=([g for g in groups if g in one_process],),
                                  name="farm-one-process", daemon=True)
        try:
            beside.start()
            self._run_lane([g for g in groups if g not in one_process])
            beside.join()
        finally:
            (self.root / "done").touch()

    def _run_lane(self, groups: list[str]) -> None:
        for group in groups:
            self._run_group([j for j in self.jobs if j.group == group])

    def stop(self) -> None:
        """End the farm's launches now and start no other (session interrupted); idempotent, and safe from another
        thread while a launch starts or ends: a launch starting now is waited for (`_launch` holds the lock) and
        killed, so once stop() returns no launch runs and none will."""
        with self._lock:
            self._stopped, procs = True, list(self.procs)
        for proc in procs:
            self._kill(proc)

    def _launch(self, cmd: list[str], log: Path) -> subprocess.Popen | None:
        """Start the launch and register it as a running one, unless the farm is stopped (None: nothing started).
        The check and the start are one step under the lock that stop() takes."""
        with self._lock:
            if self._stopped:
                return None
            with open(log, "w") as out:
                proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
            self.procs.add(proc)
            if self._stopped:  # stop() ran on this thread during Popen (the lock is reentrant) and saw no launch
                self._kill(proc)
            return proc

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        """SIGKILL the launch: torchrun's ranks first (each leads a process group of its own, which the launch's
        group signal misses: a hung rank was left running), then torchrun's group."""
        import psutil

        if proc.poll() is not None:
            return
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def _run_group(self, jobs: list[Job]) -> None:
        attempt, first = 0, jobs[0]
        while (pending := [j for j in jobs if not self._outcome_path(j).exists()]) and not self._stopped:
            attempt += 1
            tag = f"{first.group}-{attempt}"
            plan = self.root / f"plan-{tag}.json"
            plan.write_text(json.dumps({"torchrun": not first.one_process, "jobs": [
                {"key": j.key, "kind": j.kind, "payload": j.payload, "timeout_s": j.timeout_s,
                 "dir": str(self._dir(j))} for j in pending]}))
            program = ["-m", "tests.helpers.farm_rank", str(plan)]
            cmd = [sys.executable, *program] if first.one_process else torchrun_cmd(first.world, program)
            log = self.root / f"launch-{tag}.log"
            if (proc := self._launch(cmd, log)) is None:
                return
            try:
                timed_out = self._watch(proc, pending)
                code = proc.wait()
            finally:
                with self._lock:
                    self.procs.discard(proc)
            for job in pending:
                if not self._outcome_path(job).exists():
                    self._write_failure(job, code, log, timed_out)
                    break

    def _watch(self, proc: subprocess.Popen, pending: list[Job]) -> Job | None:
        """Wait for the launch; kill it when its current job runs past its timeout, and return that job."""
        current, since = None, time.monotonic()
        while proc.poll() is None:
            self._beat()
            job = next((j for j in pending if not self._outcome_path(j).exists()), None)
            if job is not current:
                current, since = job, time.monotonic()
            if job is not None and time.monotonic() - since > job.timeout_s:
                self._dump_stacks(proc)
                self._kill(proc)
                return job
            time.sleep(0.5)
        return None

    def _dump_stacks(self, proc: subprocess.Popen) -> None:
        """Ask every rank for its Python stacks (farm_rank enables the dump per job), as the launcher does."""
        import psutil

        from backend.runtime.protocol import STACK_SIGNAL

        for p in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if "tests.helpers.farm_rank" in p.cmdline() and "torch.distributed.run" not in p.cmdline():
                    p.send_signal(STACK_SIGNAL)
        time.sleep(2.0)

    def _write_failure(self, job: Job, code: int, log: Path, timed_out: Job | None) -> None:
        from backend.launch.outcome import classify_exit
        from backend.launch.stacks import hang_report

        job_dir = self._dir(job)
        log_text = log.read_text(errors="replace")
        if timed_out is job:
            where, rank = hang_report(job_dir) or ("no rank answered the stack-dump signal", None)
            failure = {"status": "timeout", "failing_rank": rank, "traceback": None,
                       "error": f"did not finish within its {job.timeout_s:.0f} s (launch killed); {where}"}
        else:
            f = classify_exit(job_dir, code, log_text)
            failure = {"status": str(f.status), "error": f.error, "failing_rank": f.failing_rank,
                       "traceback": f.traceback}
        tails = [f"--- {p.name} ---\n{p.read_text(errors='replace')[-3000:]}"
                 for p in sorted(job_dir.glob("rank-*.log"))]
        failure["log_tail"] = "\n".join(tails) or log_text[-4000:]
        _write_json(self._outcome_path(job), failure)

    def _beat(self) -> None:
        (self.root / "driver.alive").touch()

    # ---- the tests' side --------------------------------------------------------------------------------------

    def result(self, job: Job) -> Any:
        """The job's value once it has run; a failed job fails the calling test (JobFailed) with its own error."""
        __tracebackhide__ = True
        if job.key not in self.declared:
            raise JobFailed(f"farm job {job.name!r} is not declared: mark the test with tests.helpers.farm.uses(job)")
        outcome = self._wait(job)
        if outcome["status"] != "ok":
            raise JobFailed(f"farm job {job.name!r} ({job.kind}, world {job.world}) {outcome['status']}: "
                            f"{outcome['error']}\n{outcome.get('traceback') or ''}\n{outcome.get('log_tail', '')}")
        if job.kind in ("engine", "jax"):
            return self._engine_value(job)
        return outcome["value"]

    def _wait(self, job: Job) -> dict[str, Any]:
        path, started = self._outcome_path(job), time.monotonic()
        while not path.exists():
            if (self.root / "done").exists() and not path.exists():
                raise JobFailed(f"the farm finished without running {job.name!r} (not in its plan)")
            beat = self.root / "driver.alive"
            age = time.time() - beat.stat().st_mtime if beat.exists() else time.monotonic() - started
            if age > DRIVER_GONE_S:
                raise JobFailed(f"the farm's driver stopped {age:.0f} s ago without an outcome for {job.name!r}")
            time.sleep(0.2)
        return json.loads(path.read_text())

    def _engine_value(self, job: Job) -> dict[str, Any]:
        from backend.frameworks.assemblers import assembler_for

        spec = ExperimentSpec.from_json(job.payload)
        payload = json.loads((self._dir(job) / "ranks.json").read_text())
        logs = {int(p.stem.split("-")[1]): p.read_text(errors="replace") for p in self._dir(job).glob("rank-*.log")}
        return {"result": assembler_for(spec)(spec, payload), "ranks": payload["ranks"], "log": logs}

    def _dir(self, job: Job) -> Path:
        return self.root / job.key

    def _outcome_path(self, job: Job) -> Path:
        return self._dir(job) / OUTCOME


def _write_json(path: Path, data: Any) -> None:
    from backend.atomic_io import write_json_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, data)


def order_items(items: list[pytest.Item]) -> None:
    """Files whose tests read the farm go last, by the launch group they read first: the farm runs while the other
    files run (tests/helpers/schedule.py then orders the whole run, keeping this order among the files that read the
    farm). A test waiting for the farm may wait longer than pytest-timeout's default: its job's own timeout bounds
    it."""
    groups = list(dict.fromkeys(j.group for j in jobs_of(items)))
    file_rank: dict[str, int] = {}
    for item in items:
        for mark in item.iter_markers("farm"):
            rank = 1 + min(groups.index(j.group) for j in mark.args)
            file_rank[item.nodeid.split("::")[0]] = min(file_rank.get(item.nodeid.split("::")[0], rank), rank)
            if not item.get_closest_marker("timeout"):
                item.add_marker(pytest.mark.timeout(3 * 3600))
    items.sort(key=lambda i: file_rank.get(i.nodeid.split("::")[0], 0))


def farm_root(basetemp: Path) -> Path:
    """The session's farm folder: shared by pytest-xdist's workers (their base temp folders are its children)."""
    return (basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp) / "farm"


def run_now(jobs: list[Job], root: Path) -> dict[str, Any]:
    """Outside the test session (benchmarks/): `jobs` in a farm of their own under `root`, {job name: value}; the first
    failed job raises JobFailed."""
    farm = Farm(root, jobs)
    farm.run()
    return {j.name: farm.result(j) for j in jobs}
