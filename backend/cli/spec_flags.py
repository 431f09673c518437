"""Flags that mirror the experiment spec, shared by `estimate`, `run` and `submit` (and any command using
`add_spec_flags`), plus --preset / --hf-config FILE / --run-here for the model section."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from backend.cli.one_value import OneValueConst, OneValueStore, OneValueToggle
from backend.hf.config import HFConfigError, from_hf_config, load_hf_config
from backend.presets import preset_model, preset_names, scaled_for_cpu
from backend.spec import ExperimentSpec, validate_spec
from backend.spec.choices import ZERO_STAGE, RecomputeModule, Strategy
from backend.spec.fields import FLAGS, STACK_SWITCHES, SWITCHES
from backend.spec.user_text import InputError, load_json_file


def add_spec_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--spec", type=Path, help="experiment spec JSON file; flags override its fields")
    for flag, (section, field, typ) in FLAGS.items():
        kw: dict[str, Any] = {"dest": f"spec_{field}", "default": None, "action": OneValueStore}
        if isinstance(typ, list):
            kw["choices"] = typ
        else:
            kw["type"] = typ
            kw["metavar"] = {int: "N", float: "X", str: "TEXT"}[typ]
        parser.add_argument(flag, help=f"spec {section + '.' if section else ''}{field}", **kw)
    for flag, f in SWITCHES.items():
        action = "store_true" if f.flag_kind == "switch" else argparse.BooleanOptionalAction
        parser.add_argument(flag, dest=f"spec_{f.name}", action=action, default=None, help=f.flag_help)
    parser.add_argument("--zero-stage", dest="zero_stage", type=int, choices=[0, 1, 2, 3],
                        help="shorthand for --strategy ddp|zero1|zero2|zero3")
    parser.add_argument("--tie-embeddings", dest="spec_tie_embeddings", action=argparse.BooleanOptionalAction,
                        default=None, help="spec model.tie_embeddings (lm_head shares tok_emb's weight)")
    parser.add_argument("--shared-expert-gate", dest="spec_shared_expert_gate", action=argparse.BooleanOptionalAction,
                        default=None, help="spec model.shared_expert_gate")
    parser.add_argument("--moe-pad-to-capacity", dest="spec_moe_pad_to_capacity", action=argparse.BooleanOptionalAction,
                        default=None, help="spec model.moe_pad_to_capacity (every expert's input padded to its "
                                           "capacity)")
    parser.add_argument("--moe-grouped-gemm", dest="spec_moe_grouped_gemm", action=argparse.BooleanOptionalAction,
                        default=None, help="spec model.moe_grouped_gemm (local experts as one grouped GEMM)")
    for flag, field in STACK_SWITCHES.items():
        parser.add_argument(flag, dest=f"spec_{field}", action=OneValueToggle, default=None,
                            help=f"spec train.{field} (default: the stack's)")
    parser.add_argument("--recompute-modules", dest="spec_recompute_modules", nargs="*", default=None,
                        choices=[m.value for m in RecomputeModule], metavar="MODULE",
                        help="spec train.recompute_modules: what --recompute selective checkpoints on --stack megatron "
                             "(Megatron-Core's --recompute-modules: " + ", ".join(m.value for m in RecomputeModule)
                             + "; none given: nothing; flag absent: core_attn)")
    parser.add_argument("--async-tp", dest="spec_tp_overlap", action=OneValueConst, const=True,
                        help="torchtitan's name for --tp-comm-overlap")
    parser.add_argument("--compile", dest="spec_compile", action="store_true", default=None,
                        help="torch.compile: --elementwise compiled")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--preset", choices=preset_names(),
                     help="model shape of a published model (exact parameter count)")
    src.add_argument("--hf-config", type=Path, metavar="FILE",
                     help="Hugging Face config.json (llama, mistral, mixtral, qwen2, qwen2_moe, gpt2, gpt_neox, "
                          "deepseek_v3, deepseek_v2, qwen3, qwen3_moe, gpt_oss, gemma3_text, llama4_text)")
    parser.add_argument("--run-here", action="store_true",
                        help="scale the --preset/--hf-config model down for this CPU, keeping its family")


def spec_dict_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The spec as a plain dict: --spec file first, then --preset / --hf-config (the model section), then each
    flag that was given. Raises HFConfigError for a config ShardLab cannot model."""
    data: dict[str, Any] = load_spec_file(args.spec) if getattr(args, "spec", None) else {}
    model_src = _model_source(args)
    if model_src is not None:
        data["model"] = model_src
    if (strategy := strategy_of(args)) is not None:
        data.setdefault("parallel", {})["strategy"] = strategy
    for _flag, (section, field, _) in FLAGS.items():
        _put(data, section, field, getattr(args, f"spec_{field}"))
    for f in SWITCHES.values():
        _put(data, "parallel", f.name, getattr(args, f"spec_{f.name}", None))
    _put(data, "model", "tie_embeddings", getattr(args, "spec_tie_embeddings", None))
    _put(data, "model", "shared_expert_gate", getattr(args, "spec_shared_expert_gate", None))
    _put(data, "model", "moe_pad_to_capacity", getattr(args, "spec_moe_pad_to_capacity", None))
    _put(data, "model", "moe_grouped_gemm", getattr(args, "spec_moe_grouped_gemm", None))
    for field in STACK_SWITCHES.values():
        _put(data, "train", field, getattr(args, f"spec_{field}", None))
    _put(data, "train", "recompute_modules", getattr(args, "spec_recompute_modules", None))
    if getattr(args, "spec_compile", None):
        if getattr(args, "spec_elementwise", None) not in (None, "compiled"):
            raise InputError(f"--compile means --elementwise compiled; --elementwise {args.spec_elementwise} "
                             "contradicts it")
        _put(data, "train", "elementwise", "compiled")
    return data


def strategy_of(args: argparse.Namespace) -> str | None:
    """--strategy, or the one --zero-stage N names (ddp, zero1..3); None with neither. InputError where both are given
    and --strategy is not a ZeRO stage N flavour (--zero-stage 3 --strategy fsdp agree)."""
    stage, strategy = getattr(args, "zero_stage", None), getattr(args, "spec_strategy", None)
    if stage is None:
        return strategy
    named = str(next(s for s, n in ZERO_STAGE.items() if n == stage))  # the first strategy of stage N: ddp..zero3
    if strategy is not None and ZERO_STAGE.get(Strategy(strategy)) != stage:
        raise InputError(f"--zero-stage {stage} means --strategy {named}; --strategy {strategy} contradicts it")
    return strategy or named


def load_spec_file(path: Path) -> dict[str, Any]:
    """A --spec file as a dict; InputError (size, depth, not JSON, not an object) with the reason."""
    data = load_json_file(path, "--spec")
    if not isinstance(data, dict):
        raise InputError(f"--spec {path} holds a JSON {type(data).__name__}, not an object of spec sections")
    data = unwrap_imported(data, path)
    for section in ("model", "train", "parallel", "runtime"):
        if section in data and not isinstance(data[section], dict):
            raise InputError(f"--spec {path}: section {section!r} is a JSON {type(data[section]).__name__}, not an "
                             "object")
    return data


def unwrap_imported(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """`import-config --json` output ({"spec", "ignored", "unmapped"}) is accepted as a --spec: its spec, with a note
    on stderr naming the fields the spec does not hold."""
    if not ("spec" in data and ("unmapped" in data or "ignored" in data)):
        return data
    if not isinstance(data["spec"], dict):
        raise InputError(f"--spec {path}: 'spec' is a JSON {type(data['spec']).__name__}, not an object")
    unmapped = data.get("unmapped") or {}
    if unmapped:
        from backend.spec.user_text import printable

        print(f"note: {path} is an imported {printable(data.get('framework', 'framework'))} config; not in the spec: "
              + ", ".join(printable(k) for k in unmapped), file=sys.stderr)
    return data["spec"]


def _model_source(args: argparse.Namespace) -> dict[str, Any] | None:
    """The model section from --preset or --hf-config (scaled down with --run-here), None without either."""
    preset, hf = getattr(args, "preset", None), getattr(args, "hf_config", None)
    model: dict[str, Any] | None = None
    if preset:
        model = preset_model(preset)
    elif hf is not None:
        model, notes = from_hf_config(load_hf_config(hf), seq_len=getattr(args, "spec_seq_len", None), file=str(hf))
        for n in notes:
            print(f"note: {hf}: {n}", file=sys.stderr)
    if model is not None and getattr(args, "run_here", False):
        model = scaled_for_cpu(model)
    elif getattr(args, "run_here", False):
        raise HFConfigError("--run-here scales a --preset or --hf-config model; give one")
    return model


def _put(data: dict[str, Any], section: str, field: str, value: Any) -> None:
    if value is None:
        return
    (data.setdefault(section, {}) if section else data)[field] = value


def spec_from_args(args: argparse.Namespace, *, predict_only: bool = False) -> tuple[ExperimentSpec | None, list[str]]:
    """Parse and validate; (spec, []) or (None, problems with the arithmetic). predict_only: also accept layouts this
    engine can only predict (backend.spec.checks.run_blockers), as `estimate` does."""
    try:
        data = spec_dict_from_args(args)
    except (HFConfigError, InputError) as e:
        return None, [str(e)]
    return validate_spec(data, predict_only=predict_only)
