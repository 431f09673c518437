"""Collectives in XLA's compiled HLO text (`compiled.as_text()`): type, count and payload bytes per device.

Pure Python. Payload follows ShardLab's torch convention (backend/bench/comm.py): all-reduce = the reduced
buffer, all-gather = the gathered output, reduce-scatter = the input, all-to-all = the buffer. The runner
unrolls microbatches in Python, so every collective in the program runs once per step (a collective inside a
`while` body would run once per trip; `in_loop` marks any such, and the run says so).
"""

from __future__ import annotations

import re

OPS = {"all-reduce": "all_reduce", "all-gather": "all_gather", "reduce-scatter": "reduce_scatter",
       "all-to-all": "all_to_all", "collective-permute": "send"}
DTYPE_BYTES = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8, "s8": 1, "u8": 1,
               "pred": 1, "s16": 2, "u16": 2}
_INSTR = re.compile(r"=\s*(?P<shape>\([^()]*\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
                    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?P<start>-start)?\(")
_SHAPE = re.compile(r"([a-z]+[0-9]*)\[([0-9,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")  # mesh['axis_0'=4,'axis_1'=1] {'axis_0'}
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$")
_WHILE_BODY = re.compile(r"while\(.*body=%?([\w.\-]+)")


def shape_bytes(shape: str) -> list[int]:
    out = []
    for dtype, dims in _SHAPE.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out.append(n * DTYPE_BYTES.get(dtype, 4))
    return out


def group_size(line: str) -> int:
    m = _GROUPS_LIST.search(line)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = _GROUPS_IOTA.search(line)
    if m:
        return int(m.group(1).split(",")[-1])
    m = _GROUPS_MESH.search(line)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        n = 1
        for axis in re.findall(r"'([^']+)'", m.group(2)):
            n *= sizes.get(axis, 1)
        return n
    return 0


def collectives(hlo_text: str) -> dict[str, dict[str, float]]:
    """{collective: {"calls", "bytes", "group_sizes": [...], "in_loop": calls inside while bodies}}."""
    bodies = set(_WHILE_BODY.findall(hlo_text))
    out: dict[str, dict] = {}
    current = ""
    for line in hlo_text.splitlines():
        c = _COMPUTATION.match(line.strip())
        if c and "=" not in line.split("{")[0]:
            current = c.group("name")
        m = _INSTR.search(line)
        if not m:
            continue
        key = OPS[m.group("op")]
        sizes = shape_bytes(m.group("shape"))
        if m.group("start") and m.group("op") in ("all-gather", "reduce-scatter", "collective-permute") and sizes:
            sizes = sizes[-1:]  # async start returns (operand, output[, ...]): the output is the payload
        if m.group("op") == "reduce-scatter":
            sizes = [b * max(group_size(line), 1) for b in sizes]  # input = output x group size
        row = out.setdefault(key, {"calls": 0, "bytes": 0, "group_sizes": [], "in_loop": 0})
        row["calls"] += 1
        row["bytes"] += sum(sizes)
        n = group_size(line)
        if n and n not in row["group_sizes"]:
            row["group_sizes"].append(n)
        if current in bodies:
            row["in_loop"] += 1
    return out
