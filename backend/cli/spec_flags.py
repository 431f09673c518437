"""Flags that mirror the experiment spec, shared by `estimate`, `run` and `submit`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from backend.spec import Framework, Offload  # issue 14
from backend.spec import Backend, Optimizer, Precision, Recompute, Schedule, Strategy, validate_spec, ExperimentSpec
from backend.spec import Executor

# flag -> (section, field, type); a flag left unset keeps the --spec file's value or the spec default.
FLAGS: dict[str, tuple[str, str, Any]] = {
    "--name": ("", "name", str),
    "--vocab": ("model", "vocab_size", int),
    "--hidden": ("model", "d_model", int),
    "--layers": ("model", "n_layers", int),
    "--heads": ("model", "n_heads", int),
    "--kv-heads": ("model", "n_kv_heads", int),
    "--ffn": ("model", "ffn_hidden", int),
    "--seq": ("model", "seq_len", int),
    "--experts": ("model", "n_experts", int),
    "--top-k": ("model", "top_k", int),
    "--global-batch": ("train", "global_batch", int),
    "--micro-batch": ("train", "micro_batch", int),
    "--microbatches": ("train", "microbatches", int),
    "--steps": ("train", "steps", int),
    "--warmup-steps": ("train", "warmup_steps", int),
    "--precision": ("train", "precision", [v.value for v in Precision]),
    "--optimizer": ("train", "optimizer", [v.value for v in Optimizer]),
    "--lr": ("train", "lr", float),
    "--recompute": ("train", "recompute", [v.value for v in Recompute]),
    "--seed": ("train", "seed", int),
    "--strategy": ("parallel", "strategy", [v.value for v in Strategy]),
    "--world": ("parallel", "world_size", int),
    "--dp": ("parallel", "dp", int),
    "--tp": ("parallel", "tp", int),
    "--pp": ("parallel", "pp", int),
    "--ep": ("parallel", "ep", int),
    "--schedule": ("parallel", "pp_schedule", [v.value for v in Schedule]),
    "--virtual-stages": ("parallel", "virtual_stages", int),
    "--backend": ("runtime", "backend", [v.value for v in Backend]),
    "--nnodes": ("runtime", "nnodes", int),
    "--node-rank": ("runtime", "node_rank", int),
    "--rdzv-endpoint": ("runtime", "rdzv_endpoint", str),
    "--timeout": ("runtime", "timeout_s", float),
    "--framework": ("", "framework", [v.value for v in Framework]),
    "--offload": ("parallel", "offload", [v.value for v in Offload]),
    "--executor": ("runtime", "executor", [v.value for v in Executor]),
    "--nodes": ("runtime", "nnodes", int),
}


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", type=Path, help="experiment spec JSON file; flags override its fields")
    for flag, (section, field, typ) in FLAGS.items():
        kw: dict[str, Any] = {"dest": f"spec_{field}", "default": None}
        if isinstance(typ, list):
            kw["choices"] = typ
        else:
            kw["type"] = typ
            kw["metavar"] = {int: "N", float: "X", str: "TEXT"}[typ]
        parser.add_argument(flag, help=f"spec {section + '.' if section else ''}{field}", **kw)
    parser.add_argument("--sequence-parallel", dest="spec_sequence_parallel", action="store_true", default=None)
    parser.add_argument("--zero-stage", dest="zero_stage", type=int, choices=[0, 1, 2, 3],
                        help="shorthand for --strategy ddp|zero1|zero2|zero3")


def spec_dict_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The spec as a plain dict: --spec file first, then each flag that was given."""
    data: dict[str, Any] = json.loads(args.spec.read_text()) if getattr(args, "spec", None) else {}
    if getattr(args, "zero_stage", None) is not None:
        data.setdefault("parallel", {})["strategy"] = ("ddp", "zero1", "zero2", "zero3")[args.zero_stage]
    for flag, (section, field, _) in FLAGS.items():
        _put(data, section, field, getattr(args, f"spec_{field}"))
    _put(data, "parallel", "sequence_parallel", getattr(args, "spec_sequence_parallel", None))
    return data


def _put(data: dict[str, Any], section: str, field: str, value: Any) -> None:
    if value is None:
        return
    (data.setdefault(section, {}) if section else data)[field] = value


def spec_from_args(args: argparse.Namespace) -> tuple[ExperimentSpec | None, list[str]]:
    """Parse and validate; (spec, []) or (None, problems with the arithmetic)."""
    try:
        data = spec_dict_from_args(args)
    except (OSError, json.JSONDecodeError) as e:
        return None, [f"cannot read --spec {args.spec}: {e}"]
    return validate_spec(data)
