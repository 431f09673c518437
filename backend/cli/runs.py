"""The run history: list, show, cancel, requeue, delete, tag.

Text people typed (names, tags, errors) is printed with control characters escaped, so it cannot move the cursor or
fake rows. `delete` also removes the run's folders that are bound to it (backend/run_folders.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from backend.cli import fail
from backend.cli.store_options import (
    add_db_flag,
    add_filter_flags,
    dump_json,
    filter_kwargs,
    guarded,
    open_store,
    row_limit,
    run_id,
)
from backend.result import PARITY_FAILS, parity_bound, parity_verdict, rank_step_s_median
from backend.spec.user_text import InputError, printable


def add_list_flags(p: argparse.ArgumentParser) -> None:
    add_db_flag(p)
    add_filter_flags(p)
    p.add_argument("--limit", type=row_limit, default=50, help="rows (0 = all; default 50)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=guarded(cmd_list))


def add_show_flags(p: argparse.ArgumentParser) -> None:
    add_db_flag(p)
    p.add_argument("id", type=run_id)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=guarded(cmd_show))


def add_cancel_flags(p: argparse.ArgumentParser) -> None:
    add_id_flags(p, cmd_cancel)


def add_requeue_flags(p: argparse.ArgumentParser) -> None:
    add_id_flags(p, cmd_requeue)


def add_delete_flags(p: argparse.ArgumentParser) -> None:
    add_id_flags(p, cmd_delete)


def add_id_flags(p: argparse.ArgumentParser, handler: Callable[[argparse.Namespace], int]) -> None:
    """A command that acts on one experiment by id."""
    add_db_flag(p)
    p.add_argument("id", type=run_id)
    p.set_defaults(func=guarded(handler))


def add_tag_flags(p: argparse.ArgumentParser) -> None:
    add_db_flag(p)
    p.add_argument("id", type=run_id)
    p.add_argument("tags", nargs="*")
    p.set_defaults(func=guarded(cmd_tag))


def cmd_list(args) -> int:
    from db import queries as q

    rows = q.list_experiments(open_store(args), limit=args.limit or None, **filter_kwargs(args))
    if args.json:
        print(dump_json(rows))
        return 0
    print(f"{'id':>5} {'status':<11} {'strategy':<8} {'world':>5} {'dp×tp×pp×ep':<12} {'progress':<14} {'step_s':>8} "
          f"{'tokens/s':>9}  name [tags]")
    for r in rows:
        prog = f"{r['progress_phase'] or ''} {r['progress_step']}/{r['progress_total']}" if r["progress_total"] else ""
        degrees = f"{r['dp']}×{r['tp']}×{r['pp']}×{r['ep']}"
        step = f"{r['step_s_median']:.4f}" if r["step_s_median"] is not None else "-"
        tps = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] is not None else "-"
        tags = f" [{', '.join(printable(t) for t in r['tags'])}]" if r["tags"] else ""
        status = f"{r['status']}{DIVERGED_MARK if r.get('diverged') else ''}"
        print(f"{r['id']:>5} {status:<11} {r['strategy']:<8} {r['world_size']:>5} {degrees:<12} {printable(prog):<14} "
              f"{step:>8} {tps:>9}  {printable(r['name'])}{tags}")
    return 0


def cmd_show(args) -> int:
    from db import queries as q

    row = q.get_experiment(open_store(args), args.id)
    if row is None:
        print(f"error: no experiment with id {args.id}", file=sys.stderr)
        return 1
    if args.json:
        print(dump_json(experiment_json(row)))
        return 0
    spec, result, unreadable = row.pop("spec"), row.pop("result"), row.pop("result_error", None)
    stored = row.pop("spec_json", None)  # the spec as stored, when this version cannot read it (spec_error says why)
    for k, v in row.items():
        if v not in (None, "", [], {}) and k not in ("log_tail", "traceback", "env", "diverged"):
            print(f"{k:>18}: {printable(', '.join(v) if k == 'tags' else v)}")
    precision = str(spec.train.precision) if spec is not None else row["precision"]
    if (parity := parity_verdict(precision, row.get("loss_max_abs_diff"))) is not None:
        print(f"{'loss_parity':>18}: {parity.upper() if parity == PARITY_FAILS else parity} "
              f"(bound {parity_bound(precision):g} for {precision})")
    if (line := diverged_line(result, row.get("diverged"))) is not None:
        print(f"{'diverged':>18}: {line}")
    if unreadable:
        print(f"{'result':>18}: {printable(unreadable)}")
    if result is not None and result.imported is not None:  # a log's allocator peaks, not tracked categories
        print(f"\nimported from {result.imported.framework}; rank  peak_allocated  peak_reserved  predicted_total  "
              "step_s_median")
        for r in result.per_rank:
            med = rank_step_s_median(r.step_s)
            print(f"{r.rank:>4}  {r.cuda_max_allocated_bytes if r.cuda_max_allocated_bytes is not None else '-':>14}  "
                  f"{r.cuda_max_reserved_bytes if r.cuda_max_reserved_bytes is not None else '-':>13}  "
                  f"{r.predicted.peak_bytes:>15}  {med if med is not None else '-'}")
    elif result is not None:
        print("\nrank  measured_peak  predicted_peak  step_s_median")
        for r in result.per_rank:
            med = rank_step_s_median(r.step_s)
            peak = r.measured.peak_bytes if result.memory_measured else "-"
            print(f"{r.rank:>4}  {peak:>13}  {r.predicted.peak_bytes:>14}  {med if med is not None else '-'}")
    if row.get("log_tail") and row["status"] != "ok":
        print("\nlog tail:\n" + row["log_tail"])
    print("\nspec:\n" + (spec.to_json() if spec is not None else printable(stored)))
    return 0


DIVERGED_MARK = " diverged"
"""After the status in `list` ("ok diverged"): a loss of this run was NaN or inf."""


def diverged_line(result, diverged: bool | None) -> str | None:
    """Where the loss stopped being finite (`show`), or None for a run that did not diverge."""
    where = result.divergence() if result is not None else None
    if where is None:
        return "yes: a stored loss is NaN or inf" if diverged else None
    return f"yes: {where}"


def experiment_json(row: dict) -> dict:
    """`show ID --json`: the row's columns, its spec and its result as JSON (import-run --json prints the same)."""
    row = dict(row)
    spec, result, stored = row.pop("spec"), row.pop("result"), row.pop("spec_json", None)
    for key in ("result_error", "spec_error"):
        if row.get(key) is None:
            row.pop(key, None)  # only a row whose stored result (spec) does not read has the key
    precision = str(spec.train.precision) if spec is not None else row.get("precision")
    parity = parity_verdict(precision, row.get("loss_max_abs_diff"))
    shown = spec.model_dump(mode="json") if spec is not None else _as_stored(stored)
    return {**row, "loss_parity": parity, "spec": shown,
            "result": result.model_dump(mode="json", by_alias=True) if result else None}


def _as_stored(spec_json: str | None):
    """A spec this version cannot read, as stored: its JSON, or the text itself when it is not JSON."""
    try:
        return json.loads(spec_json or "null")
    except ValueError:
        return spec_json


def _lifecycle(args, action) -> int:
    from db import queries as q

    try:
        print(action(q, open_store(args), args.id))
    except q.NotFound as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except InputError as e:
        return fail(str(e))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_cancel(args) -> int:
    return _lifecycle(args, lambda q, e, i: q.cancel_live_experiment(e, i))


def cmd_requeue(args) -> int:
    return _lifecycle(args, lambda q, e, i: q.requeue_experiment(e, i))


def cmd_delete(args) -> int:
    from backend.worker.cleanup import delete_run, runs_dirs

    def delete(_q, engine, i) -> str:
        removed = delete_run(engine, i, runs_dirs(engine))
        return f"deleted {i}" + "".join(f"; removed its run folder {f}" for f in removed)

    return _lifecycle(args, delete)


def cmd_tag(args) -> int:
    return _lifecycle(args, lambda q, e, i: json.dumps(q.set_tags(e, i, args.tags), ensure_ascii=False))
