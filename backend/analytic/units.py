"""Byte-unit helpers: GB is decimal (1e9, as the ZeRO paper uses), GiB is binary (2**30)."""

from __future__ import annotations

GB = 1e9
GiB = float(2**30)
MB = 1e6
MiB = float(2**20)
KiB = float(2**10)


def to_gb(n_bytes: float) -> float:
    return n_bytes / GB


def to_gib(n_bytes: float) -> float:
    return n_bytes / GiB


def to_mib(n_bytes: float) -> float:
    return n_bytes / MiB
