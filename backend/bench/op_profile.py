"""Run the operation tables (op_probe.py) within a time budget and turn them into one hardware profile in
`hardware.json`'s format, so `estimate --hardware KEY` can use it via SHARDLAB_HARDWARE.

The profile keeps the datasheet's peaks and link bandwidths where the device is known (hardware.json's entry
for it: a single GPU cannot measure NVLink or the NIC, and a fraction of a datasheet peak is what the step-time
model's efficiencies are), and sets the tunables the tables measure:
- gemm_efficiency_max: best bf16 GEMM FLOP/s / peak; gemm_half_flops: least squares of the saturating
  e(F) = e_max·F / (F + F_half) over every measured bf16 shape (the model's size dependence, compute.gemm_s);
- attention_flash_efficiency: median flash-kernel FLOP/s (forward + backward) / peak;
- memory_efficiency: best copy bandwidth / datasheet HBM bandwidth;
- kernel_launch_s: the larger of the device time per tiny kernel and the host time per launch call.
An unknown device keeps its best measured values as peaks (efficiencies 1) and says so in `source`.
The raw tables are under `measured` (keyed by shape), with the provenance (device, date, versions).
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import socket
import time
from collections.abc import Callable
from datetime import UTC, datetime
from statistics import median
from typing import Any

import torch

from backend.bench import op_probe
from backend.bench.op_timing import TIMING, Deadline

DATASHEET_KEYS = {
    "nvidia h100 80gb hbm3": "h100-sxm", "nvidia h100 sxm5 80gb": "h100-sxm", "nvidia h100 pcie": "h100-pcie",
    "nvidia h200": "h200", "nvidia a100-sxm4-40gb": "a100-40gb-sxm", "nvidia a100-sxm4-80gb": "a100-80gb-sxm",
    "nvidia b200": "b200", "amd instinct mi300x": "mi300x",
}
"""torch.cuda.get_device_name() (lower case) -> hardware.json datasheet profile; exact names only, as
engine/device_facts.py PEAKS (an "H100" substring is three different parts)."""
SHARES = (("gemm_bf16", 0.35), ("gemm_fp8", 0.10), ("gemm_fp8_rowwise", 0.05), ("attention", 0.30),
          ("elementwise", 0.12), ("optimizer", 0.08), ("launch", 0.025), ("host_copy", 0.025))
"""Share of the probe's budget per table; time a table leaves unused passes to the ones after it."""


def datasheet_key(device_name: str | None) -> str | None:
    return DATASHEET_KEYS.get(str(device_name or "").strip().lower())


def device_facts(device: torch.device) -> dict[str, Any]:
    """Name, memory and versions of the probed device (the profile's provenance)."""
    facts: dict[str, Any] = {"device_type": device.type, "torch": torch.__version__,
                             "python": platform.python_version(), "host": socket.gethostname(),
                             "date": datetime.now(UTC).isoformat(timespec="seconds")}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(device_name=torch.cuda.get_device_name(device), memory_bytes=int(props.total_memory),
                     sm_count=int(props.multi_processor_count), compute_capability=f"{props.major}.{props.minor}",
                     cuda=torch.version.cuda, cudnn=_safe(torch.backends.cudnn.version),
                     nccl=_safe(lambda: ".".join(map(str, torch.cuda.nccl.version()))))
    else:
        from backend.bench.env import cpu_name

        facts.update(device_name=cpu_name(),
                     memory_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), cores=os.cpu_count(),
                     threads=torch.get_num_threads())
    return facts


def _safe(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a missing version is recorded, not fatal
        return f"unavailable ({type(e).__name__})"


def fp8_supported(device: torch.device) -> tuple[bool, str | None]:
    """fp8 `_scaled_mm` runs on Hopper and later (compute capability >= 8.9) and on the CPU in recent torch."""
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return False, f"torch {torch.__version__} has no torch._scaled_mm / float8_e4m3fn"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return False, ("fp8 GEMMs need compute capability >= 8.9 (this device: "
                       f"{torch.cuda.get_device_capability(device)})")
    return True, None


def measure_tables(device: torch.device, sizes: op_probe.Sizes, budget_s: float,
                   on_table: Callable[[str, float], None] | None = None) -> dict[str, Any]:
    """Every table, each guarded and bounded by its share of budget_s; {name: table, "seconds": {name: s}}."""
    end = time.monotonic() + budget_s
    out: dict[str, Any] = {"seconds": {}}
    fp8_ok, fp8_why = fp8_supported(device)
    runners: dict[str, Callable[[Deadline], dict[str, Any]]] = {
        "gemm_bf16": lambda d: op_probe.gemm_table(device, sizes, d, fp8=False),
        "gemm_fp8": (lambda d: op_probe.gemm_table(device, sizes, d, fp8=True)) if fp8_ok
        else (lambda d: {"rows": [], "skipped": fp8_why}),
        "gemm_fp8_rowwise": (lambda d: op_probe.gemm_table(device, sizes, d, fp8=True, rowwise=True)) if fp8_ok
        else (lambda d: {"rows": [], "skipped": fp8_why}),
        "attention": lambda d: op_probe.attention_table(device, sizes, d),
        "elementwise": lambda d: op_probe.elementwise_table(device, sizes, d),
        "optimizer": lambda d: op_probe.optimizer_table(device, sizes, d),
        "launch": lambda d: op_probe.launch_table(device, sizes),
        "host_copy": lambda d: op_probe.host_copy_table(device, sizes),
    }
    for k, (name, share) in enumerate(SHARES):
        rest = sum(s for _, s in SHARES[k:])
        left = end - time.monotonic()
        t0 = time.monotonic()
        try:
            out[name] = runners[name](Deadline.after(left * share / rest))
        except Exception as e:  # noqa: BLE001 - a table that fails entirely is recorded with its reason
            out[name] = {"rows": [], "error": f"{type(e).__name__}: {str(e)[:500]}"}
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        out["seconds"][name] = time.monotonic() - t0
        if on_table:
            on_table(name, out["seconds"][name])
    return out


def _ok(table: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    return [r for r in (table or {}).get("rows", []) if r.get(key)]


def fit_half_flops(points: list[tuple[float, float]], e_max: float) -> float | None:
    """F_half minimising the squared error of e(F) = e_max·F/(F + F_half) over (FLOPs, efficiency) points
    (a log-spaced search: the model is monotone in F_half, one parameter needs no solver)."""
    if not points or e_max <= 0:
        return None
    grid = [10 ** (5 + k / 20) for k in range(0, 241)]  # 1e5 .. 1e17 FLOPs
    return min(grid, key=lambda fh: sum((e_max * f / (f + fh) - e) ** 2 for f, e in points))


def tunables(tables: dict[str, Any], peak_bf16: float, hbm_bytes_per_s: float) -> dict[str, float]:
    tune: dict[str, float] = {}
    gemm = _ok(tables.get("gemm_bf16"), "flops_per_s")
    if gemm and peak_bf16:
        points = [(r["flops"], r["flops_per_s"] / peak_bf16) for r in gemm]
        tune["gemm_efficiency_max"] = max(e for _, e in points)
        half = fit_half_flops(points, tune["gemm_efficiency_max"])
        if half:
            tune["gemm_half_flops"] = half
    flash = [r for r in _ok(tables.get("attention"), "fwd_s") if r["kernel"] == "flash"]
    if flash and peak_bf16:
        tune["attention_flash_efficiency"] = median(
            (r["fwd_flops"] + r["bwd_flops"]) / (r["fwd_s"] + r["bwd_s"]) / peak_bf16 for r in flash)
    copy = [r["bytes_per_s"] for r in _ok(tables.get("elementwise"), "bytes_per_s") if r["op"] == "copy"]
    if copy and hbm_bytes_per_s:
        tune["memory_efficiency"] = max(copy) / hbm_bytes_per_s
    launch = tables.get("launch") or {}
    if launch.get("device_s_per_kernel"):
        tune["kernel_launch_s"] = max(launch["device_s_per_kernel"], launch.get("host_s_per_launch") or 0.0)
    return {k: v for k, v in tune.items() if v is not None and math.isfinite(v)}


def profile_entry(tables: dict[str, Any], facts: dict[str, Any], datasheet: dict[str, Any] | None) -> dict[str, Any]:
    """One hardware.json entry for the probed device (datasheet: its hardware.json entry, or None)."""
    gemm = _ok(tables.get("gemm_bf16"), "flops_per_s")
    copy = [r["bytes_per_s"] for r in _ok(tables.get("elementwise"), "bytes_per_s") if r["op"] == "copy"]
    best_flops = max((r["flops_per_s"] for r in gemm), default=0.0)
    kind = "gpu" if facts["device_type"] == "cuda" else "cpu"
    if datasheet:
        base = {k: datasheet[k] for k in ("peak_flops", "hbm_bytes_per_s", "intra_bytes_per_s", "inter_bytes_per_s",
                                          "gpus_per_node") if k in datasheet}
        why = (f"peaks, HBM and link bandwidths from the datasheet entry {facts.get('datasheet_key')!r} "
               f"({datasheet.get('source', '')}); tunables measured")
    else:
        best_copy = max(copy, default=0.0)
        base = {"peak_flops": {"bf16": best_flops, "fp16": best_flops, "fp32": best_flops},
                "hbm_bytes_per_s": best_copy, "intra_bytes_per_s": best_copy, "inter_bytes_per_s": best_copy,
                "gpus_per_node": 1}
        why = "no datasheet entry for this device: peaks are the best measured values (efficiencies 1), links = copy"
    peak = float(base["peak_flops"].get("bf16") or 0.0)
    entry = {"name": f"{facts.get('device_name')} (measured {facts['date'][:10]})", "kind": kind,
             "memory_bytes": float(facts.get("memory_bytes") or 0), **base,
             "tune": tunables(tables, peak, float(base["hbm_bytes_per_s"] or 0.0)),
             "source": f"backend/bench/hw_probe.py --device {facts['device_type']} on {facts.get('device_name')} "
                       f"at {facts['date']}, torch {facts['torch']}, CUDA {facts.get('cuda')}; {why}",
             "provenance": facts, "measured": tables}
    if kind == "cpu":
        entry["cores"] = facts.get("cores") or 1
    return entry


def profile_key(facts: dict[str, Any]) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", str(facts.get("device_name") or "device").lower()).strip("-")
    return f"measured-{slug[:48]}"


def probe_profile(device: torch.device, sizes: op_probe.Sizes, budget_s: float,
                  on_table: Callable[[str, float], None] | None = None) -> tuple[str, dict[str, Any]]:
    """(profile key, hardware.json entry) of this device, measured within budget_s."""
    from backend.analytic.steptime.hardware import DATA_FILE

    facts = device_facts(device)
    key = datasheet_key(facts.get("device_name"))
    facts["datasheet_key"] = key
    datasheet = json.loads(DATA_FILE.read_text())["profiles"].get(key) if key else None
    tables = measure_tables(device, sizes, budget_s, on_table)
    tables["timing"] = TIMING  # per-call spans without the host launch (op_timing.py)
    return profile_key(facts), profile_entry(tables, facts, datasheet)
