"""Device time of one profiled step by kernel category, from torch.profiler's Chrome trace (pure Python).

Each device event (kernel, memcpy, memset) is tied to the CPU ops that launched it: its `correlation` id names a
CUDA runtime call, and the CPU ops and record_function ranges open on that thread at that moment are its
ancestors (outermost first). The category comes from the kernel's name and those ancestors (`category`). Without
any device event (a CPU run) the leaf CPU ops stand in for kernels, so the same summary works on both.
Written by hand: torch's key_averages() groups by op, not by the kernels' categories nor with idle time.
"""

from __future__ import annotations

import re
from bisect import insort
from collections.abc import Iterable
from typing import Any

CATEGORIES = ("gemm", "attention_fwd", "attention_bwd", "norm_elementwise", "cross_entropy", "optimizer", "nccl",
              "memcpy_memset_copies", "other")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
CPU_CATS = ("cpu_op", "user_annotation")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
GEMM_NAMES = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90_", "sm80_", "ampere_", "hopper_")
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul")
ATTENTION_NAMES = ("flash", "fmha", "attention", "sdpa")
ATTENTION_OPS = ("scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention")
COPY_OPS = ("aten::copy_", "aten::_to_copy", "aten::cat", "aten::_foreach_copy_", "aten::contiguous", "aten::clone",
            "fsdp::copy_in", "fsdp::all_gather_copy_out", "aten::split_with_sizes_copy")
ELEMENTWISE_NAMES = ("norm", "elementwise", "reduce", "vectorized", "silu", "mul", "add", "rsqrt", "pow", "mean",
                     "fill", "softmax")
TOP_KERNELS = 25
_PER_MODULE = re.compile(r" \(.*\)$| for \S+$")


def category(name: str, ancestors: list[str], cat: str = "kernel") -> str:
    """One of CATEGORIES for a device event (or a CPU leaf op) `name` launched under `ancestors`."""
    n = name.lower()
    anc = [a.lower() for a in ancestors]
    inner = anc[-1] if anc else ""
    joined = " | ".join(anc)
    if cat in ("gpu_memcpy", "gpu_memset") or n.startswith(("memcpy", "memset")):
        return "memcpy_memset_copies"
    if "nccl" in n or "c10d::" in n:
        return "nccl"
    if "optimizer.step" in joined or "adam" in n or "_fused_adam" in joined:
        return "optimizer"
    if any(k in n for k in ATTENTION_NAMES) or any(k in joined for k in ATTENTION_OPS):
        return "attention_bwd" if ("bwd" in n or "backward" in n or "backward" in joined) else "attention_fwd"
    if any(k in joined for k in ("nll_loss", "log_softmax", "cross_entropy")):
        return "cross_entropy"
    if any(k in n for k in GEMM_NAMES) or inner in GEMM_OPS or n in GEMM_OPS:
        return "gemm"
    if "copy" in n or inner in COPY_OPS or n in COPY_OPS or "foreach_copy" in joined:
        return "memcpy_memset_copies"
    if any(k in n for k in ELEMENTWISE_NAMES):
        return "norm_elementwise"
    return "other"


def _ancestors_at(intervals: list[dict[str, Any]], points: list[tuple[float, Any]]) -> dict[Any, list[str]]:
    """For each (time, key) point, the names of the intervals open at that time (outermost first); one sweep."""
    out: dict[Any, list[str]] = {}
    ivs = sorted(intervals, key=lambda e: (e["ts"], -e.get("dur", 0)))
    open_: list[tuple[float, float, int, str]] = []  # (start, -end, order, name): outermost first
    i = 0
    for t, key in sorted(points, key=lambda p: p[0]):
        while i < len(ivs) and ivs[i]["ts"] <= t:
            e = ivs[i]
            insort(open_, (e["ts"], -(e["ts"] + e.get("dur", 0)), i, e["name"]))
            i += 1
        open_ = [o for o in open_ if -o[1] > t]
        out[key] = [o[3] for o in open_]
    return out


def union_s(spans: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by the union of (start_us, end_us) spans."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total / 1e6


def device_events(trace: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """(events with "ancestors", basis): CUDA kernels/copies tied to their launching CPU ops, else CPU leaf ops."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    cpu = [e for e in events if e.get("cat") in CPU_CATS]
    dev = [e for e in events if e.get("cat") in DEVICE_CATS]
    by_tid: dict[Any, list[dict[str, Any]]] = {}
    for e in cpu:
        by_tid.setdefault(e.get("tid"), []).append(e)
    if dev:
        launches = {e["args"]["correlation"]: e for e in events
                    if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
        points: dict[Any, list[tuple[float, Any]]] = {}
        for j, e in enumerate(dev):
            launch = launches.get(e.get("args", {}).get("correlation"))
            if launch is not None:
                points.setdefault(launch.get("tid"), []).append((launch["ts"], j))
        anc: dict[Any, list[str]] = {}
        for tid, pts in points.items():
            anc.update(_ancestors_at(by_tid.get(tid, []), pts))
        return [dict(e, ancestors=anc.get(j, [])) for j, e in enumerate(dev)], "cuda kernels"
    leaves = []
    for evs in by_tid.values():
        evs = sorted(evs, key=lambda e: (e["ts"], -e.get("dur", 0)))
        for k, e in enumerate(evs):
            end = e["ts"] + e.get("dur", 0)
            child = k + 1 < len(evs) and evs[k + 1]["ts"] < end
            if not child and e.get("cat") == "cpu_op":
                leaves.append(e)
        anc = _ancestors_at(evs, [(e["ts"] + 1e-3, id(e)) for e in leaves])
        for e in leaves:
            e["ancestors"] = anc.get(id(e), [])[:-1]
    return [dict(e, cat="kernel") for e in leaves], "cpu leaf ops"


def summarize(trace: dict[str, Any], step_wall_s: float) -> dict[str, Any]:
    """Per-category device seconds, busy (union) vs the step's wall seconds, the top kernels, FSDP2 hook CPU time."""
    evs, basis = device_events(trace)
    cats = {c: {"seconds": 0.0, "count": 0} for c in CATEGORIES}
    kernels: dict[str, dict[str, Any]] = {}
    for e in evs:
        c = category(e["name"], e["ancestors"], e.get("cat", "kernel"))
        s = e.get("dur", 0) / 1e6
        cats[c]["seconds"] += s
        cats[c]["count"] += 1
        k = kernels.setdefault(e["name"][:160], {"name": e["name"][:160], "category": c, "count": 0, "seconds": 0.0})
        k["count"] += 1
        k["seconds"] += s
    spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in evs]
    busy = union_s(spans)
    compute = union_s((e["ts"], e["ts"] + e.get("dur", 0)) for e in evs
                      if category(e["name"], e["ancestors"], e.get("cat", "kernel")) != "nccl")
    span_s = (max(b for _, b in spans) - min(a for a, _ in spans)) / 1e6 if spans else 0.0
    return {"basis": basis, "events": len(evs), "step_wall_s": step_wall_s, "device_busy_s": busy,
            "device_busy_without_nccl_s": compute, "device_span_s": span_s,
            "idle_s": max(0.0, step_wall_s - busy), "categories": cats,
            "top_kernels": sorted(kernels.values(), key=lambda k: -k["seconds"])[:TOP_KERNELS],
            "cpu_ranges": cpu_ranges(trace)}


def cpu_ranges(trace: dict[str, Any]) -> dict[str, dict[str, float]]:
    """CPU seconds and calls of FSDP2's hooks (its record_function ranges "FSDP::...", summed over modules) and the
    optimizer step. Nested ranges are each counted (FSDP::pre_forward contains FSDP::all_gather)."""
    out: dict[str, dict[str, float]] = {}
    for e in trace.get("traceEvents", []):
        name = str(e.get("name", ""))
        if e.get("ph") == "X" and e.get("cat") in CPU_CATS and name.startswith(("FSDP::", "Optimizer.step")):
            row = out.setdefault(_PER_MODULE.sub("", name)[:120], {"seconds": 0.0, "count": 0})
            row["seconds"] += e.get("dur", 0) / 1e6
            row["count"] += 1
    return out
