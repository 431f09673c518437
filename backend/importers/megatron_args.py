"""Megatron-LM's `pretrain_gpt.py` arguments -> a ShardLab spec, from a shell line, a file of them, or the
"arguments" block a Megatron log prints at start (megatron/training/arguments.py `_print_args`: one
"  name .......... value" line per argument between "---- arguments ----" and "---- end of arguments ----").

The line is split with shlex (POSIX rules, backslash-newline continuations joined) and never run: a launcher
before the script (torchrun --nproc-per-node N --nnodes M) gives the GPU count, shell variables are not expanded.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from backend.importers.assemble import to_spec
from backend.importers.fields import Flat, apply_table
from backend.importers.imported import ConfigImportError, ImportedConfig, safe_name
from backend.importers.megatron_fields import OFF_VALUES, PREFIXES, TABLE, literal, model_and_layout, training
from backend.spec.user_text import MAX_JSON_FILE_BYTES, over_limit

BLOCK_START = re.compile(r"-{4,} arguments -{4,}")
BLOCK_END = re.compile(r"-{4,} end of arguments -{4,}")
BLOCK_LINE = re.compile(r"^\s+([A-Za-z_][A-Za-z0-9_]*) \.+ (.*)$")
LAUNCHER_GPUS = {"--nproc_per_node": "per_node", "--nproc-per-node": "per_node", "--nnodes": "nodes"}


def looks_like_args(text: str) -> bool:
    return bool(BLOCK_START.search(text)) or "--num-layers" in text or "--hidden-size" in text


def parse(text: str | bytes) -> tuple[dict[str, Any], str, int | None]:
    """({--flag: value}, source_format, GPUs from the launcher or the printed world_size)."""
    raw = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    if BLOCK_START.search(raw):
        return _block(raw), "megatron-log-args", None
    # The file's size, not its re-encoded text's: a file read with errors="replace" (read_config_file, an upload) has
    # a 3-byte U+FFFD where it had an undecodable byte (a 5.0 MiB binary file re-encodes to 9.0 MiB).
    size = len(text) if isinstance(text, bytes) else len(raw.encode()) - 2 * raw.count("\ufffd")
    if size > MAX_JSON_FILE_BYTES:
        raise ConfigImportError([over_limit("the argument list", size, MAX_JSON_FILE_BYTES)])
    joined = re.sub(r"\\\r?\n", " ", raw)
    try:
        tokens = shlex.split(joined, comments=True)
    except ValueError as e:
        raise ConfigImportError([f"cannot split the argument list as a shell line: {e}"]) from None
    return _flags(tokens)


def _flags(tokens: list[str]) -> tuple[dict[str, Any], str, int | None]:
    script = next((i for i, t in enumerate(tokens) if t.endswith(".py")), -1)
    launcher, args = tokens[:script + 1] if script >= 0 else [], tokens[script + 1:] if script >= 0 else tokens
    gpus = _launcher_gpus(launcher)
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
            out[key] = token if current is True else (current + [token] if isinstance(current, list) else [current, token])
        else:
            raise ConfigImportError([f"{token!r} is not an argument (--name value): only pretrain_gpt.py's flags are read"])
    if not out:
        raise ConfigImportError(["no --arguments found: give the pretrain_gpt.py command line or a file of its flags"])
    return out, "megatron-args", gpus


def _launcher_gpus(tokens: list[str]) -> int | None:
    found: dict[str, int] = {}
    for i, token in enumerate(tokens[:-1]):
        name, eq, value = token.partition("=")
        if name in LAUNCHER_GPUS:
            text = value if eq else tokens[i + 1]
            if text.isdigit():
                found[LAUNCHER_GPUS[name]] = int(text)
    return found["per_node"] * found.get("nodes", 1) if "per_node" in found else None


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
                file: str = "args") -> ImportedConfig:
    flags, source_format, launcher_gpus = parse(text)
    block = source_format == "megatron-log-args"
    flat = Flat(flags)
    apply_table(flat, TABLE, prefixes=PREFIXES)
    if block:  # Megatron prints every argument: an unknown one that is unset is not worth a line
        for key in [k for k, v in flat.unmapped.items() if v["value"] in OFF_VALUES and k not in TABLE]:
            flat.ignore(key, flat.unmapped.pop(key)["value"], "unset in the printed arguments")
    if launcher_gpus is not None and flat.get("gpus") is None:
        flat.put("gpus", launcher_gpus, "the launcher's --nproc-per-node x --nnodes")
    if model_config is not None:
        _hf_vocab(flat, model_config)
    flat.put("dp", -1 if flat.get("mg_dp") is None else flat.get("mg_dp"), "data-parallel size (WORLD_SIZE / (tp * pp * cp))")
    notes = model_and_layout(flat) + training(flat)
    flat.put("notes", notes, "megatron")
    if flat.problems:
        raise ConfigImportError(flat.problems)
    name = f"Megatron {flat.get('n_layers')} layers x {flat.get('d_model')} ({safe_name(file, 60)})"
    return to_spec(flat, framework="megatron", source_format=source_format, name=name, gpus=gpus)


def _hf_vocab(flat: Flat, cfg: dict[str, Any]) -> None:
    vocab = cfg.get("vocab_size")
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 and flat.get("mg_vocab") is None:
        flat.put("mg_vocab", vocab, "--model-config vocab_size")
