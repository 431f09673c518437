"""Typed reads of config.json keys for backend/hf/config.py and backend/hf/families.py: each names the key it
cannot use (HFConfigError), never a bare KeyError or TypeError."""

from __future__ import annotations

from typing import Any

REQUIRED = object()
DEFAULT_SEQ_CAP = 8192


class HFConfigError(ValueError):
    """A config ShardLab cannot model; the message names the field."""


def family(cfg: dict[str, Any]) -> str:
    return str(cfg.get("model_type"))


def read_int(cfg: dict[str, Any], key: str, default: Any = REQUIRED, minimum: int = 1) -> Any:
    """cfg[key] as an integer >= minimum; `default` when absent or null (HFConfigError naming the key otherwise)."""
    value = cfg.get(key)
    if value is None:
        if default is REQUIRED:
            raise HFConfigError(f"config.json lacks {key}, which model_type {family(cfg)} needs")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise HFConfigError(f"{key}={value!r} must be an integer >= {minimum}")
    return value


def read_num(cfg: dict[str, Any], key: str, default: float) -> float:
    """cfg[key] as a positive finite number, `default` when absent or null."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise HFConfigError(f"{key}={value!r} must be a positive number")
    return float(value)


def read_flag(cfg: dict[str, Any], key: str, default: bool) -> bool:
    """cfg[key] as true/false, `default` when absent or null."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise HFConfigError(f"{key}={value!r} must be true or false")
    return value


def read_str(cfg: dict[str, Any], key: str, allowed: tuple[str, ...], default: str | None = None) -> str | None:
    """cfg[key] as one of `allowed`, `default` when absent or null."""
    value = cfg.get(key)
    if value is None:
        return default
    if value not in allowed:
        raise HFConfigError(f"{key}={value!r} is not modelled (expected one of {', '.join(allowed)})")
    return value


def read_int_list(cfg: dict[str, Any], key: str) -> list[int]:
    """cfg[key] as a list of integers >= 0 ([] when absent or null)."""
    value = cfg.get(key)
    if value is None:
        return []
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        raise HFConfigError(f"{key}={value!r} must be a list of integers >= 0")
    return value


def read_seq(cfg: dict[str, Any], seq_len: int | None, max_key: str, notes: list[str]) -> int:
    """The sequence length: the caller's, else max_key capped at DEFAULT_SEQ_CAP (noted); above max_key refused."""
    max_pos = read_int(cfg, max_key, None)
    if seq_len is None:
        seq_len = min(max_pos or DEFAULT_SEQ_CAP, DEFAULT_SEQ_CAP)
        notes.append(f"seq_len={seq_len} (from {max_key}={max_pos}, capped at {DEFAULT_SEQ_CAP}); set --seq to change")
    elif max_pos and seq_len > max_pos:
        raise HFConfigError(f"seq_len={seq_len} exceeds {max_key}={max_pos}")
    return seq_len
