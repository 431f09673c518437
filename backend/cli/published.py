"""`python -m backend published`: the model against every published training run of the stacks users train with
(Megatron-Core / NeMo, torchtitan, DeepSpeed, MosaicML's and the papers' own): per row the predicted step and peak
memory beside the published ones, and per stack and GPU the mean and worst |error| against issue 34's targets.

  python -m backend published                    # every row, then the summary per stack and GPU
  python -m backend published --stack megatron   # one stack's rows
  python -m backend published --summary          # the summary alone
  python -m backend published --json             # {"rows": [...], "summaries": [...], "targets": {...}}

Each row is predicted through its own spec (`estimate --spec ROW.json --hardware HW` prints the same step); the rows
and their sources: backend/analytic/steptime/published_gpu.json. Error = (predicted - published) / published:
negative = the model is too fast. Nothing is fitted to these rows. The Formulas page's "Published runs" tab shows the
same tables.
"""

from __future__ import annotations

import argparse
import json

from backend.analytic.steptime.published_check import (
    RESERVED_TARGET_PCT,
    STEP_MEAN_TARGET_PCT,
    STEP_WORST_TARGET_PCT,
    ErrorStats,
    RowCheck,
    StackSummary,
    check_rows,
    summaries,
)
from backend.spec.stacks import STACK_CHOICES


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stack", choices=STACK_CHOICES, help="only this stack's rows")
    p.add_argument("--summary", action="store_true", help="print the summary per stack and GPU alone")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def row_dict(c: RowCheck) -> dict:
    m = c.memory
    return {"id": c.row.id, "stack": c.row.stack, "group": c.row.group, "hardware": c.row.hardware,
            "layout": c.row.layout, "published_step_s": c.row.step_s, "predicted_step_s": c.predicted_step_s,
            "step_error_pct": c.step_error_pct, "published_memory_gib": c.row.memory_gib,
            "predicted_fullest_gib": m.fullest_gib if m else None, "fullest_moment": m.moment if m else None,
            "predicted_reserved_gib": m.reserved_gib if m else None, "memory_error_pct": c.memory_error_pct,
            "fit_verdict": m.verdict if m else None, "caveats": list(c.caveats), "source": c.row.source,
            "url": c.row.url}


def _stats(s: ErrorStats | None) -> dict | None:
    return None if s is None else {"rows": s.rows, "mean_abs_pct": s.mean_abs_pct, "mean_pct": s.mean_pct,
                                   "worst_pct": s.worst_pct}


def summary_dict(s: StackSummary) -> dict:
    return {"stack": s.stack, "hardware": s.hardware, "moe": s.moe, "step": _stats(s.step),
            "step_target_met": s.step_target_met, "reserved": _stats(s.reserved),
            "fullest_under_published": s.fullest_under_published, "fits": s.fits, "tight": s.tight,
            "fit_rows": s.fit_rows}


TARGETS = {"step_mean_abs_pct": STEP_MEAN_TARGET_PCT, "step_worst_pct": STEP_WORST_TARGET_PCT,
           "reserved_within_pct": RESERVED_TARGET_PCT,
           "note": "step targets per stack on H100 (dense rows); memory: fullest <= published peak reserved, reserved "
                   f"within {RESERVED_TARGET_PCT:g}% of it, every row fits its GPU"}


def _row_line(c: RowCheck) -> str:
    m = c.memory
    mem = "-"
    if c.row.memory_gib is not None and m is not None:
        mem = f"{c.row.memory_gib:.1f} / {m.fullest_gib:.1f} / {m.reserved_gib:.1f} ({c.memory_error_pct:+.0f}%)"
    return (f"{c.row.id:46s} {c.row.stack:10s} {c.row.hardware:22s} {c.row.step_s:10.3f} {c.predicted_step_s:10.3f} "
            f"{c.step_error_pct:+7.1f}%  {mem:30s} {m.verdict if m else '-'}")


def _summary_line(s: StackSummary) -> str:
    target = {True: "met", False: "NOT MET", None: "-"}[s.step_target_met]
    mem = "-"
    if s.reserved is not None:
        mem = (f"fullest <= published {s.fullest_under_published}/{s.reserved.rows}, reserved mean |err| "
               f"{s.reserved.mean_abs_pct:.1f}% worst {s.reserved.worst_pct:.1f}%")
    return (f"{s.stack:10s} {s.hardware + (' (MoE)' if s.moe else ''):28s} {s.step.rows:4d} "
            f"{s.step.mean_abs_pct:6.1f}% {s.step.mean_pct:+6.1f}% {s.step.worst_pct:6.1f}%  {target:7s}  "
            f"fit {s.fits}/{s.fit_rows}{f' (+{s.tight} tight)' if s.tight else ''}  {mem}")


def run(args: argparse.Namespace) -> int:
    checks = check_rows(args.stack)
    sums = summaries(checks)
    if args.json:
        print(json.dumps({"rows": [row_dict(c) for c in checks], "summaries": [summary_dict(s) for s in sums],
                          "targets": TARGETS}))
        return 0
    if not checks:
        print(f"no published run of stack {args.stack} is on record (backend/analytic/steptime/published_gpu.json)")
        return 0
    if not args.summary:
        print(f"{'row':46s} {'stack':10s} {'hardware':22s} {'published s':>10s} {'predicted':>10s} {'error':>8s}  "
              f"{'peak GiB: published / fullest / reserved':30s} fit")
        for c in checks:
            print(_row_line(c))
        for c in checks:
            for caveat in c.caveats:
                print(f"{c.row.id}: step time assumes: {caveat}")
        print()
    print(f"{'stack':10s} {'hardware':28s} {'rows':>4s} {'mean|e|':>7s} {'mean':>7s} {'worst':>7s}  "
          f"{'target':7s}  memory")
    for s in sums:
        print(_summary_line(s))
    print(f"\nstep target (issue 34, dense rows on H100): mean |error| <= {STEP_MEAN_TARGET_PCT:g}%, worst <= "
          f"{STEP_WORST_TARGET_PCT:g}%; error = (predicted - published) / published, negative = the model is too "
          "fast. Sources: backend/analytic/steptime/published_gpu.json")
    return 0
