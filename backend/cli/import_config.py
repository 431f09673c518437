"""`python -m backend import-config FILE`: a torchtitan, Megatron-LM / NeMo or DeepSpeed config as a ShardLab spec.

  python -m backend import-config llama3_8b.toml --gpus 64 --json > spec.json    # torchtitan job TOML
  python -m backend import-config train.log --format torchtitan --gpus 64         # Trainer.Config dump in a log
  python -m backend import-config pretrain_llama70b.sh --gpus 64                  # Megatron arguments (or a NeMo .yaml)
  python -m backend import-config train_mixtral.sh --gpus 32 --vocab 32000        # a launch script (arrays, variables)
  python -m backend import-config ds_config.json --model-config config.json --gpus 16
  python -m backend estimate --spec spec.json --hardware h100-sxm                 # estimate/plan/trace/submit take it

--json prints {"spec": {...}, "ignored": {...}, "unmapped": {...}} (+ "framework", "source_format", "gpus", "notes"):
every source field that is not in the spec is listed by name with its value and the reason. The config is read as
data; nothing in it is executed (a launch script's variables, arrays and branches are followed, never run). Exit 2
with the arithmetic for a config ShardLab cannot express, and with what to give (--vocab N) where it lacks a value.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from backend.cli import fail


def add_flags(p: argparse.ArgumentParser) -> None:
    add_import_flags(p)
    p.add_argument("--json", action="store_true", help='print {"spec", "ignored", "unmapped"} as JSON')
    p.set_defaults(func=run)


def add_import_flags(p: argparse.ArgumentParser, *, config_flag: bool = False) -> None:
    from backend.importers import registry

    if config_flag:
        p.add_argument("--config", type=Path, required=True, metavar="FILE", help="the run's framework config")
    else:
        p.add_argument("file", type=Path, help="the framework's config (TOML, arguments, YAML, JSON, or a log holding "
                                               "it)")
    p.add_argument("--format", choices=registry.names(),
                   help=f"default: told from the file ({registry.what_each_reads()})")
    p.add_argument("--gpus", type=int, metavar="N", help="GPUs of the job: resolves degrees written as -1 or auto")
    p.add_argument("--model-config", type=Path, metavar="FILE", help="the model's Hugging Face config.json ("
                   + "; ".join(registry.model_config_uses()) + ")")
    p.add_argument("--seq", type=int, metavar="N", help="sequence length where the config has none "
                   f"({registry.labels_where(lambda f: f.takes_seq)})")
    p.add_argument("--vocab", type=int, metavar="N", help="vocabulary size where a "
                   f"{registry.labels_where(lambda f: f.takes_vocab)} config leaves it to the tokenizer")


def imported_from_args(args: argparse.Namespace):
    """(ImportedConfig, None) or (None, the problems as one message)."""
    from backend.importers import ConfigImportError, import_config

    path = getattr(args, "config", None) or args.file
    try:
        return import_config(path, fmt=args.format, gpus=args.gpus, model_config=args.model_config, seq_len=args.seq,
                             vocab_size=args.vocab), None
    except ConfigImportError as e:
        return None, f"cannot import {path}:\n  " + "\n  ".join(e.problems + needs_hints(e.needs))


def needs_hints(needs: tuple[str, ...]) -> list[str]:
    """How to supply, on the command line, what an import needs."""
    from backend.importers.import_result import VOCAB_SIZE

    return ["give the vocabulary size with --vocab N, or the model's config.json with --model-config FILE"
            for need in needs if need == VOCAB_SIZE]


def run(args: argparse.Namespace) -> int:
    imported, problem = imported_from_args(args)
    if imported is None:
        return fail(problem)
    if args.json:
        print(json.dumps(imported.to_dict(), indent=2, ensure_ascii=True))
        return 0
    print(summary_text(imported))
    return 0


def summary_text(imported) -> str:
    from backend.analytic.params import count_params
    from backend.importers.import_result import layout_text
    from backend.spec import ExperimentSpec
    from backend.spec.user_text import printable

    spec = ExperimentSpec.for_prediction(imported.spec)
    p, t = spec.parallel, spec.train
    lines = [f"{imported.framework} ({imported.source_format}), {imported.gpus} GPUs: {p.strategy} world "
             f"{p.world_size} = {layout_text(imported.spec['parallel'])}; {count_params(spec.model):,} parameters, seq "
             f"{spec.model.seq_len}, global batch {t.global_batch} = micro {t.micro_batch} x {t.microbatches} "
             f"microbatches x dp {p.dp}, {t.precision}, recompute {t.recompute}"]
    for key, entry in imported.unmapped.items():
        lines.append(f"unmapped {printable(key)} = {printable(json.dumps(entry['value'], default=str))[:80]}: "
                     f"{printable(entry['reason'])}")
    lines.append(f"{len(imported.ignored)} fields ignored (no effect on memory or step time; --json lists them)")
    lines += [f"note: {printable(n)}" for n in imported.notes]
    return "\n".join(lines)
