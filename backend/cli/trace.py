"""`python -m backend trace`: the memory of a spec at full size, traced on fake tensors (nothing allocated).

  python -m backend trace --spec 7b.json --json                 # one JSON object (see backend/trace/trace_spec.py)
  python -m backend trace --spec 7b.json --ranks 0,63 --store   # these ranks; stored as a run of kind traced

Takes the same spec flags as `run`. By default it traces one rank per class of equivalent ranks, each in
its own process. A stored trace stops when its run is cancelled (Runs page, `python -m backend cancel ID`): the
row ends cancelled with the ranks traced so far (backend/trace/history.py). Exit code: 0 ok, 1 failed, unsupported
or cancelled (the object still printed; a cancel also says so on stderr), 2 invalid spec.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext

from backend.cli import fail
from backend.cli.spec_flags import add_spec_flags, spec_from_args


def add_flags(p: argparse.ArgumentParser) -> None:
    add_spec_flags(p)
    p.add_argument("--ranks", help="comma-separated ranks to trace (default: one per class of equivalent ranks)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--store", action="store_true", help="store the trace in the experiment history (kind traced)")
    p.add_argument("--db", help="database URL for --store (default: SHARDLAB_DB_URL or data/shardlab.db)")
    p.add_argument("--experiment-id", type=int, help=argparse.SUPPRESS)  # a row the dashboard already created
    p.set_defaults(func=run)


def parse_ranks(text: str | None) -> list[int] | None:
    """The --ranks list, sorted and distinct; None when the flag is absent (the default ranks). Given but naming no
    rank ("", ","), it is refused: falling back to the defaults would trace ranks nobody asked for."""
    if text is None:
        return None
    try:
        ranks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--ranks {text!r}: expected comma-separated integers like 0,7,63") from None
    if not ranks:
        raise ValueError(f"--ranks {text!r} names no rank: give comma-separated integers like 0,7,63, or leave "
                         "--ranks out to trace one rank per class of equivalent ranks")
    return ranks


def run(args: argparse.Namespace) -> int:
    from backend.trace.history import beating, begin_trace
    from backend.trace.trace_spec import trace_spec

    spec, problems = spec_from_args(args)
    if spec is None:
        print("error: invalid spec, nothing traced:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    try:
        ranks = parse_ranks(args.ranks)
        world = spec.parallel.world_size
        if ranks is not None and not all(0 <= r < world for r in ranks):
            raise ValueError(f"--ranks {args.ranks}: ranks must be in 0..{world - 1} (world_size={world})")
    except ValueError as e:
        return fail(str(e))
    exp_id = engine = None
    if args.store or args.experiment_id:
        from db.session import open_db

        engine = open_db(args.db)
        exp_id = args.experiment_id or begin_trace(engine, spec)
    try:
        with beating(engine, exp_id) if exp_id is not None else nullcontext() as cancel:
            result = trace_spec(spec, ranks, on_rank=lambda k, n, r: print(f"tracing rank {r} ({k}/{n})",
                                                                            file=sys.stderr, flush=True),
                                cancel=cancel)
    except BaseException as e:
        result = {"status": "failed", "error": f"{type(e).__name__}: {e}", "spec": json.loads(spec.to_json()),
                  "per_rank": [], "seconds": None, "notes": [], "kind": "traced"}
        if not isinstance(e, Exception):
            _finish(args, exp_id, spec, result)
            raise
    _finish(args, exp_id, spec, result)
    print(json.dumps(public(result), indent=1) if args.json else table(result))
    if result["status"] == "cancelled":
        print(f"trace of run {exp_id} cancelled: {result['error']}", file=sys.stderr)
    return 0 if result["status"] == "ok" else 1


def _finish(args: argparse.Namespace, exp_id: int | None, spec, result: dict) -> None:
    if exp_id is None:
        return
    from backend.trace.history import finish_trace
    from db.session import open_db

    finish_trace(open_db(args.db), exp_id, spec, result)
    result["experiment_id"] = exp_id


def public(result: dict) -> dict:
    """The CLI's JSON object: the contract keys, per rank without the tracker's raw breakdowns."""
    rows = [{k: v for k, v in r.items() if k != "memory"} for r in result.get("per_rank", [])]
    return {**{k: v for k, v in result.items() if k != "per_rank"}, "per_rank": rows}


def table(result: dict) -> str:
    from backend.number_format import fmt_bytes

    lines = [f"trace: {result['status']}" + (f"  ({result['error']})" if result.get("error") else ""),
             f"{'rank':>5} {'category':<18} {'traced':>12} {'predicted':>12} {'error':>9}"]
    for row in result.get("per_rank", []):
        for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "peak_bytes"):
            e = row["error_pct"].get(k)
            lines.append(f"{row['rank']:>5} {k:<18} {fmt_bytes(row['traced'][k]):>12} "
                         f"{fmt_bytes(row['predicted'][k]):>12} {'' if e is None else f'{e:+.2f}%':>9}")
    if result.get("seconds") is not None:
        lines.append(f"{result['seconds']:.1f} s")
    lines += [f"note: {n}" for n in result.get("notes", [])]
    return "\n".join(lines)
