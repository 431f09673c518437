"""`python -m backend run`: run one experiment as real torch.distributed processes and report it.

  python -m backend run --strategy ddp --world 2 --steps 5 --layers 2 --hidden 128     # summary table
  python -m backend run --spec S.json --json                                           # one JSON object

Progress ("step k/N (phase)") goes to stderr. Exit code: 0 ok, 1 the run failed (the result is still
printed), 2 invalid spec (nothing launched), 130 interrupted (the job is cancelled and cleaned up).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path

from backend.cli import fail
from backend.cli.run_summary import summary
from backend.cli.spec_flags import add_spec_flags, spec_from_args
from backend.result import RunResult, Status

RUNS_DIR = Path(".shardlab") / "runs"


def add_flags(p: argparse.ArgumentParser) -> None:
    add_spec_flags(p)
    p.add_argument("--json", action="store_true", help="print RunResult JSON (one object) instead of a table")
    p.add_argument("--workdir", type=Path, help="run directory (spec.json, log.txt, ranks.json, result.json); kept")
    p.add_argument("--keep", action="store_true", help=f"keep the default run directory under {RUNS_DIR}/")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    spec, problems = spec_from_args(args)
    if spec is None:
        print("error: invalid spec, nothing launched:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    if not _fits_this_host(spec):
        return 2
    if str(spec.runtime.executor) == "local":
        _ensure_cpu_profile()
    workdir = args.workdir or RUNS_DIR / datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    if workdir.exists() and not workdir.is_dir():
        return fail(f"--workdir {workdir} exists and is not a directory")
    result, interrupted = _run_interruptible(spec, workdir)
    keep = args.workdir is not None or args.keep
    print(result.to_json() if args.json else summary(result, workdir if keep else None))
    if not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    if interrupted:
        return 130
    return 0 if result.status == Status.OK else 1


def _fits_this_host(spec) -> bool:
    """The host capacity check (backend/launch/capacity.py): refusal on stderr, warnings too."""
    from backend.launch import capacity

    verdict = capacity.check(spec)
    for warning in verdict.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if not verdict.ok:
        print(f"error: nothing launched: {verdict.refusal()}", file=sys.stderr)
    return verdict.ok


def _ensure_cpu_profile() -> None:
    """Measure the 'cpu' step-time profile before the first local run, as the worker does (bench/cpu_profile.ensure:
    once, file-locked, off with SHARDLAB_AUTO_HW_PROBE=0), so the result carries step_time_predicted_s whether `run`
    or the worker ran it."""
    from backend.bench import cpu_profile

    if (note := cpu_profile.ensure(_print_progress)) is not None:
        print(note, file=sys.stderr, flush=True)


def _run_interruptible(spec, workdir: Path) -> tuple[RunResult, bool]:
    """Run on a thread so Ctrl-C or SIGTERM cancels the job (and cleans it up) instead of orphaning it.

    Returns (result, whether it was interrupted)."""
    from backend.launch.launcher import run_experiment

    cancel = threading.Event()
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["result"] = run_experiment(spec, workdir=workdir, on_progress=_print_progress, cancel=cancel)
        except BaseException as e:  # re-raised on the main thread
            box["error"] = e

    thread = threading.Thread(target=target, name="shardlab-run")
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: cancel.set())
    thread.start()
    try:
        while thread.is_alive():
            try:
                thread.join(timeout=0.5)
            except KeyboardInterrupt:
                print("interrupted: cancelling the job...", file=sys.stderr, flush=True)
                cancel.set()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"], cancel.is_set()  # type: ignore[return-value]


def _print_progress(event: dict) -> None:
    step, of, phase = event.get("step"), event.get("of"), event.get("phase", "")
    print(f"step {step}/{of} ({phase})" if step is not None else str(phase), file=sys.stderr, flush=True)
