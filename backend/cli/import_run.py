"""`python -m backend import-run`: store a run measured by torchtitan, Megatron-LM / NeMo or DeepSpeed, from its config
and its training log, as a run of kind "imported" beside ShardLab's predictions for it.

  python -m backend import-run --config llama3_8b.toml --log train.log --gpus 64 --hardware h100-sxm --tag ourcluster
  python -m backend import-run --config pretrain.sh --log megatron.log --json       # prints what `show ID --json` does

The log is streamed (any size, bounded memory); warm-up steps are excluded by a stated rule (--warmup-steps N sets
the cut); a cut, garbled or multi-run log is refused or imported as partial, saying so. Nothing is stored unless the
whole import succeeds (one transaction). Calibrate a cluster profile from such runs with `calibrate --tag T`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from backend.cli import fail
from backend.cli.import_config import add_import_flags, needs_hints


def add_flags(p: argparse.ArgumentParser) -> None:
    add_import_flags(p, config_flag=True)
    p.add_argument("--log", type=Path, required=True, metavar="FILE", help="the run's training log (stdout of rank 0 "
                                                                           "or all)")
    p.add_argument("--hardware", metavar="NAME", help="step-time profile (default: the device the log names), or a "
                   "calibrated profile's name")
    p.add_argument("--tag", action="append", default=[], help="repeatable")
    p.add_argument("--warmup-steps", type=int, metavar="N", help="exclude logged steps <= N (default: the stated rule)")
    p.add_argument("--db", metavar="URL", help="database URL (default: $SHARDLAB_DB_URL or <repo>/data/shardlab.db)")
    p.add_argument("--json", action="store_true", help="print the stored run as `show ID --json` does")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from backend.cli.runs import experiment_json
    from backend.cli.store_options import dump_json
    from backend.importers import ConfigImportError
    from backend.importers.runs import import_run
    from backend.spec.user_text import InputError
    from db import queries as q
    from db.session import StoreError, open_db

    if args.warmup_steps is not None and args.warmup_steps < 0:
        return fail(f"--warmup-steps must be >= 0 (got {args.warmup_steps})")
    try:
        engine = open_db(args.db)
        eid = import_run(engine, config=args.config, log=args.log, fmt=args.format, gpus=args.gpus,
                         hardware=args.hardware, tags=args.tag, model_config=args.model_config, seq_len=args.seq,
                         warmup_steps=args.warmup_steps, db_url=args.db, vocab_size=args.vocab)
    except ConfigImportError as e:
        return fail("nothing stored:\n  " + "\n  ".join(e.problems + needs_hints(e.needs)))
    except (InputError, StoreError) as e:
        return fail(f"nothing stored: {e}")
    row = q.get_experiment(engine, eid)
    if args.json:
        print(dump_json(experiment_json(row)))
        return 0
    res = row["result"]
    facts = res.imported
    print(f"imported run {eid} ({facts.framework}): step {res.step_s_median:.4g} s median over {facts.records_used} "
          f"logged steps after step {facts.warmup_cut_step}"
          + (f", predicted {res.step_time_predicted_s:.4g} s on {facts.hardware}" if res.step_time_predicted_s else ""))
    if facts.partial:
        print("partial import: " + "; ".join(facts.partial_reasons))
    return 0
