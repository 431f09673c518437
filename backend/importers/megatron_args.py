"""Megatron-LM's `pretrain_gpt.py` arguments -> a ShardLab spec, from a launch script, a shell line, a file of them, or
the "arguments" block a Megatron log prints at start (megatron/training/arguments.py `_print_args`: one
"  name .......... value" line per argument between "---- arguments ----" and "---- end of arguments ----").

A script is read as data by shell_script.py (bash arrays, string variables, `${X:-default}`, `export`, `if` / `case`
on the script's own values; nothing is run) down to its training command; a launcher before the script (torchrun /
python -m torch.distributed.run --nproc-per-node N --nnodes M) gives the GPU count. A script that trains another
kind of model (pretrain_bert.py, pretrain_t5.py, a hybrid Mamba model, a vision-language model) is refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from backend.importers.assemble import to_spec
from backend.importers.fields import Flat, To, apply_table, mapper_for
from backend.importers.import_result import ConfigImportError, ImportedConfig, safe_name
from backend.importers.megatron_fields import (
    OFF_VALUES,
    PREFIXES,
    TABLE,
    given_vocab,
    literal,
    model_and_layout,
    training,
)
from backend.importers.shell_script import read as read_script
from backend.spec.user_text import MAX_JSON_FILE_BYTES, over_limit

BLOCK_START = re.compile(r"-{4,} arguments -{4,}")
BLOCK_END = re.compile(r"-{4,} end of arguments -{4,}")
BLOCK_LINE = re.compile(r"^\s+([A-Za-z_][A-Za-z0-9_]*) \.+ (.*)$")
LAUNCHER_GPUS = {"--nproc_per_node": "per_node", "--nproc-per-node": "per_node", "--nnodes": "nodes"}


def looks_like_args(text: str) -> bool:
    return bool(BLOCK_START.search(text)) or "--num-layers" in text or "--hidden-size" in text


@dataclass(frozen=True)
class Launcher:
    """The GPU count a launcher line states (torchrun --nproc-per-node N --nnodes M)."""
    gpus: int
    how: str
    """In the script's words: "--nproc_per_node 8 x --nnodes 1"."""
    env: frozenset[str] = frozenset()
    """Variables the script leaves to its environment whose defaults the count holds (${SLURM_NNODES:-1})."""


def parse(text: str | bytes) -> tuple[dict[str, Any], str, Launcher | None, list[str]]:
    """({--flag: value}, source_format, the launcher's GPU count, notes on how the script was read)."""
    raw = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    if BLOCK_START.search(raw):
        return _block(raw), "megatron-log-args", None, []
    # The file's size, not its re-encoded text's: a file read with errors="replace" (read_config_file, an upload) has
    # a 3-byte U+FFFD where it had an undecodable byte (a 5.0 MiB binary file re-encodes to 9.0 MiB).
    size = len(text) if isinstance(text, bytes) else len(raw.encode()) - 2 * raw.count("\ufffd")
    if size > MAX_JSON_FILE_BYTES:
        raise ConfigImportError([over_limit("the argument list", size, MAX_JSON_FILE_BYTES)])
    command = read_script(raw)
    tokens = command.words
    script = next((i for i, t in enumerate(tokens) if t.endswith(".py")), -1)
    if script >= 0:
        _check_script(tokens[script])
    launcher = _launcher(tokens[:script + 1], command.defaults[:script + 1]) if script >= 0 else None
    return _flags(tokens[script + 1:]), "megatron-args", launcher, command.notes


def _flags(args: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    key = None
    for token in args:
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            key = name
            out[key] = value if eq else True
            if eq:
                key = None
        elif key is not None:
            current = out[key]
            out[key] = token if current is True else (current + [token] if isinstance(current, list)
                                                      else [current, token])
        else:
            raise ConfigImportError([f"{token!r} is not an argument (--name value): only pretrain_gpt.py's flags are "
                                     "read"])
    if not out:
        raise ConfigImportError(["no --arguments found: give the pretrain_gpt.py command line or a file of its flags"])
    return out


NOT_GPT = {"pretrain_bert": "a BERT encoder", "pretrain_t5": "a T5 encoder-decoder",
           "pretrain_hybrid": "a hybrid Mamba-Transformer model", "pretrain_mamba": "a Mamba model",
           "pretrain_vlm": "a vision-language model", "pretrain_vision": "a vision model",
           "pretrain_retro": "a RETRO retrieval model", "pretrain_ict": "a retriever (ICT)",
           "pretrain_mimo": "a multimodal model"}


def _check_script(script: str) -> None:
    """ConfigImportError for a Megatron script that trains something other than a GPT-like decoder."""
    stem = script.rsplit("/", 1)[-1].removesuffix(".py")
    kind = NOT_GPT.get(stem) or ("a vision-language model" if stem.startswith("pretrain_vlm") else None)
    if kind:
        raise ConfigImportError([f"{stem}.py trains {kind}: ShardLab models decoder-only GPT-like transformers "
                                 "(Megatron-LM's pretrain_gpt.py), so this script cannot become a spec"])


def _launcher(tokens: list[str], defaults: list[frozenset[str]]) -> Launcher | None:
    found: dict[str, tuple[int, str, frozenset[str]]] = {}
    for i, token in enumerate(tokens[:-1]):
        name, eq, value = token.partition("=")
        if name in LAUNCHER_GPUS:
            text, env = (value, defaults[i]) if eq else (tokens[i + 1], defaults[i + 1])
            if text.isdigit() and len(text) <= 7:
                found[LAUNCHER_GPUS[name]] = (int(text), f"{name} {text}", env)
    if "per_node" not in found:
        return None
    parts = [found["per_node"]] + ([found["nodes"]] if "nodes" in found else [])
    return Launcher(gpus=parts[0][0] * (parts[1][0] if len(parts) > 1 else 1), how=" x ".join(p[1] for p in parts),
                    env=frozenset().union(*(p[2] for p in parts)))


def _block(text: str) -> dict[str, Any]:
    start = BLOCK_START.search(text)
    end = BLOCK_END.search(text, start.end())
    if end is None:
        raise ConfigImportError(["the Megatron arguments block has no '---- end of arguments ----' line: the log is "
                                 "truncated"])
    out: dict[str, Any] = {}
    for line in text[start.end():end.start()].splitlines():
        line = line.split("]:", 1)[1] if line.startswith("[") and "]:" in line[:16] else line
        if m := BLOCK_LINE.match(line):
            out["--" + m.group(1).replace("_", "-")] = literal(m.group(2).strip())
    if not out:
        raise ConfigImportError(["the Megatron arguments block holds no 'name ..... value' lines"])
    return _namespace_to_flags(out)


def _namespace_to_flags(values: dict[str, Any]) -> dict[str, Any]:
    """The printed namespace uses argparse dests: add_bias_linear=False is --disable-bias-linear, and so on."""
    if "--add-bias-linear" in values:
        values["--disable-bias-linear"] = not values.pop("--add-bias-linear")
    return values


def import_args(text: str | bytes, *, gpus: int | None = None, model_config: dict[str, Any] | None = None,
                file: str = "args", vocab_size: int | None = None) -> ImportedConfig:
    flags, source_format, launcher, script_notes = parse(text)
    block = source_format == "megatron-log-args"
    flat = Flat(flags)
    if not block:
        missing_values(flat)
    apply_table(flat, TABLE, prefixes=PREFIXES)
    if block:  # Megatron prints every argument: an unknown one that is unset is not worth a line
        for key in [k for k, v in flat.unmapped.items() if v["value"] in OFF_VALUES and k not in TABLE]:
            flat.ignore(key, flat.unmapped.pop(key)["value"], "unset in the printed arguments")
    launcher_notes = _launcher_gpus(flat, launcher, gpus) if launcher is not None and flat.get("gpus") is None else []
    if model_config is not None:
        _hf_vocab(flat, model_config)
    if vocab_size is not None:
        given_vocab(flat, vocab_size)
    flat.put("dp", -1 if flat.get("mg_dp") is None else flat.get("mg_dp"), "data-parallel size (WORLD_SIZE / (tp * pp "
                                                                           "* cp))")
    notes = model_and_layout(flat) + training(flat) + launcher_notes + script_notes
    flat.put("notes", notes, "megatron")
    if flat.problems:
        raise ConfigImportError(flat.problems, flat.needs)
    name = f"Megatron {flat.get('n_layers')} layers x {flat.get('d_model')} ({safe_name(file, 60)})"
    try:
        return to_spec(flat, framework="megatron", source_format=source_format, name=name, gpus=gpus)
    # a layout that does not fit the launcher's default GPU count: say where it came from
    except ConfigImportError as e:
        raise ConfigImportError(e.problems + launcher_notes, e.needs) from None


BARE_IS_A_VALUE = frozenset({"--recompute-modules"})
"""Flags with argparse nargs="*" in Megatron-LM's arguments.py: given bare, they hold an empty list, not nothing."""


def missing_values(flat: Flat) -> None:
    """A flag that takes a value given without one (another --flag follows it, or it ends the list): `_flags` holds
    it as True, a store_true flag's value, and its converter then said "--flag=True: expected an integer". Each such
    flag is a problem saying its value is missing and what it expects (its converter's words, tried on the bare flag),
    and leaves the table's run. A flag takes a value where its converter refuses the bare flag, or it has none."""
    for key in [k for k, v in flat.values.items() if v is True and k not in BARE_IS_A_VALUE]:
        mapper = mapper_for(key, TABLE, PREFIXES)
        if not isinstance(mapper, To):
            continue
        expected = "expected a value"
        if mapper.convert is not None:
            try:
                mapper.convert(True)
                continue  # a flag given bare: store_true
            except ValueError as e:
                expected = str(e)
        flat.problems.append(f"{key} has no value: {expected}")
        del flat.values[key]


def _launcher_gpus(flat: Flat, launcher: Launcher, gpus: int | None) -> list[str]:
    """The launcher's GPU count is the config's, unless it holds an environment default (${SLURM_NNODES:-1}) and the
    GPUs are given on import: then those decide."""
    env = ", ".join(sorted(launcher.env))
    if launcher.env and gpus is not None:
        return [f"{gpus} GPUs as given, not the launcher's {launcher.gpus} ({launcher.how}, with the script's default "
                f"for {env})"] if gpus != launcher.gpus else []
    flat.put("gpus", launcher.gpus, f"the launcher's {launcher.how}")
    return [f"{launcher.gpus} GPUs: the launcher's {launcher.how}, with the script's default for {env} (give the GPU "
            "count to import it for another cluster)"] if launcher.env else []


def _hf_vocab(flat: Flat, cfg: dict[str, Any]) -> None:
    vocab = cfg.get("vocab_size")
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 and flat.get("mg_vocab") is None:
        flat.put("mg_vocab", vocab, "--model-config vocab_size")
