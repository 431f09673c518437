"""Measured vs predicted pipeline bubble for every schedule at several microbatch counts, through the
real engine (one run per point; the timeline of the first timed step is measured).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/mp_bubble.py [--pp 2] [--m 2 4 8] [--schedules gpipe 1f1b ...]
        [--no-engine]

--no-engine runs every point of a schedule in ONE torchrun job through tests/helpers/mp_harness.py
(prepare + 2 steps, timeline of step 1, no memory-tracked step): faster, and it also covers the schedules
whose memory-tracked engine step cannot run yet (interleaved_1f1b, zero_bubble, zbv: see the report).

Measured = backend.analytic.measured.bubble_measure.measured_bubble_fraction (idle / total per rank over the
step's pipeline window, mean over ranks); predicted = backend.analytic.textbook.pipeline.bubble_fraction.
On a shared CPU the ranks compete for cores, so stage times are not equal and the measured value
carries that noise; the trend in m is the check.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.launch.launcher import run_experiment  # noqa: E402
from backend.spec import MULTI_STAGE_SCHEDULES, ExperimentSpec  # noqa: E402

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"]


def spec_for(schedule: str, pp: int, m: int, layers_per_stage: int) -> ExperimentSpec:
    v = 2 if schedule in MULTI_STAGE_SCHEDULES else 1
    return ExperimentSpec.model_validate({
        "name": f"bubble-{schedule}-p{pp}-m{m}",
        "model": {"vocab_size": 128, "d_model": 128, "n_layers": pp * v * layers_per_stage, "n_heads": 4,
                  "seq_len": 64},
        "train": {"global_batch": 2 * m, "micro_batch": 2, "steps": 1, "warmup_steps": 1},
        "parallel": {"strategy": "pp", "world_size": pp, "pp": pp, "pp_schedule": schedule, "virtual_stages": v},
        "runtime": {"timeout_s": 600},
    })


def run_harness(args) -> int:
    from backend.analytic.measured.bubble_measure import measured_bubble_fraction
    from backend.analytic.textbook.pipeline import bubble_fraction
    from tests.helpers.farm import parity_job, run_now

    for schedule in args.schedules:
        specs = [spec_for(schedule, args.pp, m, args.layers_per_stage) for m in args.m]
        with tempfile.TemporaryDirectory(prefix="bubble-") as d:
            res = run_now([parity_job(s, steps=2, timeout_s=900) for s in specs], Path(d))
        for s in specs:
            r, p = res[s.name], s.parallel
            meas = measured_bubble_fraction(r["timeline"])
            pred = bubble_fraction(str(p.pp_schedule), p=p.pp, m=s.train.microbatches, v=p.virtual_stages)
            print(f"{schedule:18} {p.pp:>2} {s.train.microbatches:>3} {meas:>9.3f} {pred:>9.3f} "
                  f"{r['loss_max_abs_diff']:>10.1e} -", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--m", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--schedules", nargs="+", default=SCHEDULES)
    ap.add_argument("--layers-per-stage", type=int, default=1)
    ap.add_argument("--no-engine", action="store_true", help="measure with the test harness instead of the engine")
    args = ap.parse_args()
    print(f"{'schedule':18} {'p':>2} {'m':>3} {'measured':>9} {'predicted':>9} {'loss|diff|':>10} step_s")
    if args.no_engine:
        return run_harness(args)
    bad = 0
    for schedule in args.schedules:
        for m in args.m:
            spec = spec_for(schedule, args.pp, m, args.layers_per_stage)
            with tempfile.TemporaryDirectory(prefix="bubble-") as d:
                r = run_experiment(spec, workdir=Path(d))
            if r.status != "ok":
                print(f"{schedule:18} {args.pp:>2} {m:>3} FAILED: {r.error}")
                bad += 1
                continue
            meas = f"{r.bubble_measured:.3f}" if r.bubble_measured is not None else "-"
            pred = f"{r.bubble_predicted:.3f}" if r.bubble_predicted is not None else "-"
            print(f"{schedule:18} {args.pp:>2} {m:>3} {meas:>9} {pred:>9} {r.loss_max_abs_diff:>10.1e} "
                  f"{r.step_s_median:.3f}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
