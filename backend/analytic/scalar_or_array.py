"""Arithmetic that works on one layout (Python scalars) or many (numpy arrays), through the same call.

The prediction core writes every layout-dependent choice as `where(condition, a, b)` instead of `if`: with
Python scalars the helpers below stay in Python (exact int arithmetic, the same floats as plain code), with numpy
arrays they broadcast. `per_distinct` evaluates a scalar-only function (a formula with many branches, a partition,
a memoised lookup) once per distinct combination of its integer arguments and spreads the values back.
The same idea as Calculon's search (Isaev et al. SC'23), which calls the very model its single-config path runs.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from typing import Any, TypeAlias

import numpy as np

Num: TypeAlias = int | float | np.ndarray
"""A per-layout quantity: a Python scalar (one layout; bools included) or a numpy array (one entry per layout of a
table, or broadcast against a rank axis)."""


def is_array(*values: object) -> bool:
    for v in values:
        if isinstance(v, np.ndarray):
            return True
    return False


def where(condition: Num, if_true: Num, if_false: Num) -> Num:
    """`if_true if condition else if_false`, elementwise for arrays."""
    if isinstance(condition, np.ndarray):
        return np.where(condition, if_true, if_false)
    if condition:
        return if_true
    return if_false


def any_true(value: Num) -> bool:
    """Whether some entry is true (a scalar: itself)."""
    return bool(value.any()) if isinstance(value, np.ndarray) else bool(value)


def maximum(a: Num, b: Num) -> Num:
    return np.maximum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else max(a, b)


def minimum(a: Num, b: Num) -> Num:
    return np.minimum(a, b) if isinstance(a, np.ndarray) or isinstance(b, np.ndarray) else min(a, b)


def logical_and(*values: Num) -> Num:
    """Elementwise and; a scalar False anywhere gives scalar False (it would broadcast to all False)."""
    out = None
    for v in values:  # one pass, no generator: the estimator calls this ~100 times per rank it prices
        if isinstance(v, np.ndarray):
            out = v.astype(bool, copy=False) if out is None else out & v.astype(bool, copy=False)
        elif not v:
            return False
    return True if out is None else out


def logical_or(*values: Num) -> Num:
    """Elementwise or; a scalar True anywhere gives scalar True."""
    out = None
    for v in values:
        if isinstance(v, np.ndarray):
            out = v.astype(bool, copy=False) if out is None else out | v.astype(bool, copy=False)
        elif v:
            return True
    return False if out is None else out


def logical_not(value: Num) -> Num:
    return ~np.asarray(value, dtype=bool) if is_array(value) else not value


def ceil_div(a: Num, b: Num) -> Num:
    """ceil(a / b) for non-negative ints (exact, arrays or scalars)."""
    if isinstance(a, np.ndarray) and a.dtype.kind == "f" and type(b) is int and b > 0 and not b & (b - 1):
        return np.ceil(a / b)  # a / 2^k is exact in floats: the same value, without the slow float floor division
    return -((-a) // b)


def select(index: Num, options: list[Num]) -> Num:
    """options[index], elementwise for an array of indices (every option already computed)."""
    if isinstance(index, np.ndarray):
        out = options[0]
        for k in range(1, len(options)):
            out = np.where(index == k, options[k], out)
        return out
    return options[int(index)]


def take_rows(value: Num, rows: np.ndarray | slice, n: int) -> Num:
    """value restricted to `rows` when its first axis runs over the n rows of a table (else value itself: a
    scalar, or an array that broadcasts along that axis)."""
    if isinstance(value, np.ndarray) and value.ndim and value.shape[0] == n and n != 1:
        return value[rows]
    return value


def per_value(column: Any, fn: Callable[..., Any], *tables: Any) -> Any:
    """fn(*tables restricted to the rows where `column` == k, k) for every value k the per-row column takes, put
    back in row order: a vectorised `if` (each branch computed only on its own rows; `table.take(rows)`
    restricts). fn may return a number, an array or a tuple of them. A scalar column: fn(*tables, column)."""
    if not is_array(column):
        return fn(*tables, column)
    flat = np.asarray(column).reshape(len(column), -1)[:, 0]
    if flat.dtype == bool:
        values = [v for v, present in ((False, not flat.all()), (True, flat.any())) if present]
    # a few small choices: a count
    elif flat.dtype.kind in "iu" and len(flat) and 0 <= flat.min() and flat.max() < 4096:
        values = np.nonzero(np.bincount(flat))[0].tolist()  # np.unique's sorted values, without sorting every row
    else:
        values = np.unique(flat).tolist()
    if len(values) == 1:
        return fn(*tables, values[0])
    pieces = []
    for k in values:
        rows = np.nonzero(flat == k)[0]
        pieces.append((rows, fn(*(t.take(rows) for t in tables), k)))
    if isinstance(pieces[0][1], tuple):
        return tuple(_scatter([(rows, out[i]) for rows, out in pieces], len(flat)) for i in range(len(pieces[0][1])))
    return _scatter(pieces, len(flat))


def _scatter(pieces: list[tuple[Num, Num]], n: int) -> Any:
    arrays = [(rows, np.asarray(out, dtype=np.float64)) for rows, out in pieces]
    trailing = np.broadcast_shapes(*(a.shape[1:] if a.ndim else () for _, a in arrays))
    out = np.zeros((n,) + trailing)
    for rows, a in arrays:
        out[rows] = np.broadcast_to(a, (len(rows),) + trailing) if a.ndim else a
    return out


def select_present(index: np.ndarray, options: dict[int, Any]) -> Any:
    """options[index] elementwise, for an index array taking only the keys of `options`."""
    keys = list(options)
    out = options[keys[0]]
    for k in keys[1:]:
        out = np.where(index == k, options[k], out)
    return out


def as_int(value: Num) -> Num:
    """int(round(x)) for a scalar, np.rint for arrays (both round half to even)."""
    return np.rint(value) if is_array(value) else int(round(value))


def per_distinct(fn: Callable[..., Any], *columns: Any) -> Any:
    """fn(*row) for scalars; for arrays, fn evaluated once per distinct row of the broadcast non-negative int
    columns and spread back in the broadcast shape. Scalar columns stay fixed; the array ones are combined into one
    mixed-radix int64 key (broadcasting each column only there; np.unique(axis=0) sorts void rows ~50x slower),
    a small key range is deduplicated with a lookup table instead of a sort, and each distinct row is decoded from
    its key. fn returns a number or a tuple of numbers; arrays come back as float64 with a trailing axis for
    tuples."""
    varying = [i for i, c in enumerate(columns) if isinstance(c, np.ndarray)]
    if not varying:
        return fn(*columns)
    codes, palettes, tops = [], [], []
    for i in varying:
        c = columns[i].astype(np.int64, copy=False)
        top = int(c.max()) + 1 if c.size else 1
        if top > 64:  # a wide range (dp degrees, micro-batches): dense codes keep the key's span small
            palette, code = np.unique(c, return_inverse=True)
            c, top = code.reshape(c.shape), len(palette)
            palettes.append(palette)
        else:
            palettes.append(None)
        codes.append(c)
        tops.append(top)
    radix = [1] * len(varying)
    for j in range(len(varying) - 2, -1, -1):
        radix[j] = radix[j + 1] * tops[j + 1]
    key = 0
    for c, r in zip(codes, radix, strict=False):
        key = key + c * r
    shape = key.shape
    span = radix[0] * tops[0]
    flat = key.ravel()
    if span <= 4 * flat.size:
        seen = np.zeros(span, dtype=bool)
        seen[flat] = True
        distinct = np.nonzero(seen)[0]
        lookup = np.zeros(span, dtype=np.int64)
        lookup[distinct] = np.arange(len(distinct))
        inverse = lookup[flat]
    else:
        distinct, inverse = np.unique(flat, return_inverse=True)
    decoded = iter([(palette[(distinct // r) % t] if palette is not None else (distinct // r) % t).tolist()
                    for r, t, palette in zip(radix, tops, palettes, strict=False)])
    arguments = [next(decoded) if isinstance(c, np.ndarray) else repeat(c, len(distinct)) for c in columns]
    values = np.array([fn(*row) for row in zip(*arguments, strict=False)], dtype=np.float64)
    return values[inverse.ravel()].reshape(shape + values.shape[1:])
