"""The GPU check (issue 22 A): one prepared script that measures a GPU and runs ShardLab on it, writing its results
after every phase so that a timeout still leaves data.

On the device machine (Python 3.12, its own torch with CUDA; pydantic and pytest-timeout travel as wheels built by
`make gpu-wheels` into .gpu-wheels/, an ignored folder the run must carry), from the repository root, ONE command.
First run (measures the profile):

  python3 benchmarks/gpu_check.py --device cuda --out $OUT --budget-s 330 --wheels .gpu-wheels

A later run on the same GPU model reuses the committed profile and skips the probe:

  python3 benchmarks/gpu_check.py --device cuda --out $OUT --budget-s 370 --wheels .gpu-wheels \
      --profile benchmarks/results/gpu/2026-11-26-h200-run1/profile.json

(--wheels unpacks the wheels into a temporary folder put first on sys.path and PYTHONPATH, no pip needed; the pip
equivalent is `python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/*.whl &&
PYTHONPATH=/tmp/site python3 benchmarks/gpu_check.py --device cuda --out $OUT --budget-s 330`.)

Here: `make gpu-check` (device cpu: gloo, world 1, a tiny model, about a minute).

  python benchmarks/gpu_check.py --device cuda|cpu --out DIR [--budget-s S] [--nproc N]
      [--phases env,probe,runs,diag,trace,tests,late_runs,allocator,power] [--runs zero3,ddp,...]
      [--profile DIR/profile.json]

Phases, in priority order: env (versions, device), probe (backend/bench/hw_probe.py --device cuda: GEMM, SDPA,
element-wise, AdamW, launch and host-copy tables -> a hardware.json profile; skipped with --profile), runs (the
product's launcher and engine on NCCL: zero3, ddp, zero2, zero3 x recompute selective/full, zero3 with compiled
blocks, 6 timed steps each, and the mixes with --nproc >= 4), diag (the saved tensors of one block + head + loss on
the device and on the host CPU next to the analytic terms, and of a compiled block on the device; one torch.profiler
step of ddp and zero3 by kernel category), trace (the same specs on
fake tensors at full size), tests (the private torch API checks, then pytest -m gpu), late_runs (zero3 + params
offload: one timed step), allocator (the caching allocator's slack as a reserve and as the smallest memory cap one
1B step runs under, default and expandable_segments:True), power (each kernel class's draw and SM clock at the GPU's
own power limit: bf16 GEMM, flash and cuDNN attention, a copy; `--phases env,power` runs it alone in ~1 minute).
Output in DIR: report.json (keys env, profile, runs, diag, trace, tests, allocator, power, plus kit and phases),
summary.md (the runs' table and the diag section), profile.json (the measured or reused profile:
SHARDLAB_HARDWARE=DIR/profile.json), kit.log.
`python -m backend ingest DIR` stores the runs as ordinary results, tagged with the GPU they ran on.
A reused profile measured on another GPU model is recorded but not used for the predictions (report.profile.not_used).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def use_wheels(folder: Path) -> Path:
    """Unpack every wheel in `folder` into one site folder, first on sys.path and on the children's PYTHONPATH
    (a wheel is a zip of its installed files; these have no entry points to generate)."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"error: --wheels {folder}: no .whl files (run `make gpu-wheels` and carry the folder)")
    site = Path(tempfile.gettempdir()) / "shardlab-gpu-site"
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    sys.path.insert(0, str(site))
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(site) + (os.pathsep + old if old else "")
    print(f"[gpu_check] unpacked {len(wheels)} wheels from {folder} into {site}", flush=True)
    return site


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="benchmarks/gpu_check.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True)
    ap.add_argument("--out", type=Path, required=True, help="folder for report.json, summary.md, profile.json, kit.log")
    ap.add_argument("--budget-s", type=float, default=330.0, help="wall-clock budget of the whole check (default 330)")
    ap.add_argument("--nproc", type=int, default=1, help="GPUs (ranks) per run; >= 4 adds the TP and PP mixes")
    ap.add_argument("--phases", default=None, help="comma-separated subset of "
                                                   "env,probe,runs,diag,trace,tests,late_runs,allocator")
    ap.add_argument("--runs", default=None, help="comma-separated subset of the runs (default: all that fit)")
    ap.add_argument("--profile", type=Path, default=None, help="reuse a measured profile.json (skip the probe)")
    ap.add_argument("--wheels", type=Path, default=None, help="folder of wheels to unpack and use first (.gpu-wheels)")
    args = ap.parse_args(argv)
    if args.wheels is not None:
        use_wheels(args.wheels)
    problems = []
    if not args.budget_s > 0:
        problems.append(f"--budget-s must be > 0 (got {args.budget_s})")
    if args.nproc < 1:
        problems.append(f"--nproc must be >= 1 (got {args.nproc})")
    if args.profile is not None and not args.profile.is_file():
        problems.append(f"--profile {args.profile} is not a file")
    from backend.gpucheck.kit import parse_phases, run_kit
    from backend.gpucheck.specs import runs_for

    runs = [r.strip() for r in args.runs.split(",") if r.strip()] if args.runs else None
    reuse = args.profile is not None
    for check in (lambda: parse_phases(args.phases, reuse_profile=reuse), lambda: runs_for(args.nproc, runs)):
        try:
            check()
        except ValueError as e:
            problems.append(str(e))
    if problems:
        for p in problems:
            print(f"error: {p}", file=sys.stderr)
        return 2
    report = run_kit(args.device, args.out, budget_s=args.budget_s, nproc=args.nproc, phase_names=args.phases,
                     run_names=runs, profile=args.profile)
    failed = [k for k, v in report.get("phases", {}).items() if v.get("status") == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
