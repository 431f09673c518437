"""Hardware profiles for the step-time model: the shipped data file, a user file, and this machine's probe.

Profiles come from `hardware.json` beside this module (published datasheet peaks, with their source), then
from the JSON file named by SHARDLAB_HARDWARE (same shape; its entries add to or replace the shipped ones),
then "cpu" from the micro-benchmark backend/bench/hw_probe.py wrote (SHARDLAB_CPU_PROFILE, else
data/hardware_cpu.json). Peak FLOP/s are dense; bandwidths are per GPU and per direction.

A profile's operation tables (op_tables.py: GEMM by shape, attention by kernel, element-wise / optimizer bandwidth,
kernel floors) come from its `tables` entry (names of op_tables.json tables, or the tables themselves; attention may
list several, each adding its kernels) or, for a profile a GPU-check probe wrote, from its `measured` tables.
Where a table is missing the scalar tunables stand in (gemm_efficiency_max with the saturating size curve,
attention_flash_efficiency, memory_efficiency). Every profile states where each of its values comes from
(`provenance`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from backend.analytic.steptime.op_tables import OpTables, table_json, tables_from_json, tables_from_measured
from backend.spec.stacks import DEVICE_CLASSES

DATA_FILE = Path(__file__).with_name("hardware.json")
TABLES_FILE = Path(__file__).with_name("op_tables.json")
CPU_PROFILE_FILE = Path(__file__).resolve().parents[3] / "data" / "hardware_cpu.json"
CPU = "cpu"


@dataclass(frozen=True)
class Tunables:
    """Model parameters a calibration may fit (defaults in hardware.json "defaults")."""

    gemm_efficiency_max: float = 0.78
    gemm_half_flops: float = 2.0e9
    attention_flash_efficiency: float = 0.6
    memory_efficiency: float = 0.9
    kernel_launch_s: float = 4e-6
    intra_efficiency: float = 0.8
    inter_efficiency: float = 0.92
    intra_latency_s: float = 1e-6
    inter_latency_s: float = 5e-6
    overlap_efficiency: float = 0.9
    step_overhead_s: float = 0.005
    dtensor_op_s: float = 0.0
    """Host seconds per DTensor operator dispatch (sharding propagation, Python subclass). 0 on GPUs, whose host
    runs ahead of the kernels; a CPU rank computes on the host, so every dispatch adds (hardware.json cpu_defaults)."""
    all_gather_efficiency: float = 1.0
    """Bandwidth of an all-gather relative to the tier's (all-reduce-derived) bandwidth: 1 on NCCL; gloo differs."""
    reduce_scatter_efficiency: float = 1.0
    """The same for reduce-scatter (gloo has no ring reduce-scatter: it reduces the whole buffer)."""
    gemm_fp8_efficiency_max: float = 0.0
    """The float8 GEMMs' efficiency under fp8 (0: unmeasured, bf16's gemm_efficiency_max is used:
    Hardware.peak_note)."""
    gemm_scale: float = 1.0
    """Multiplier on the GEMM efficiency (table or curve): what a calibration fits."""
    attention_scale: float = 1.0
    """Multiplier on the attention kernels' efficiency (table or attention_flash_efficiency)."""
    elementwise_scale: float = 1.0
    """Multiplier on the element-wise bandwidth fractions (table or memory_efficiency)."""
    optimizer_scale: float = 1.0
    """Multiplier on the optimizer step's bandwidth fraction."""
    fsdp_unit_host_s: float = 0.0
    """Host seconds of FSDP2's hooks per parameter group and microbatch (pre/post forward and backward) that a
    unit's own GPU work cannot hide; 0: not measured."""


@dataclass(frozen=True)
class Hardware:
    key: str
    name: str
    kind: str
    """gpu or cpu."""
    memory_bytes: float
    """The device memory a process can use, as CUDA reports it (torch.cuda.get_device_properties().total_memory),
    which the fit check compares against: the datasheet's "80GB" is 80 GiB of HBM less the driver's reservation, not
    80e9 bytes (provenance["memory_bytes"] says where each figure comes from). CPU profiles: the host's RAM."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s by dtype: bf16, fp16, fp32."""
    hbm_bytes_per_s: float
    intra_bytes_per_s: float
    """Per-GPU, per-direction bandwidth inside a node (NVLink / Infinity Fabric / PCIe; CPU: gloo loopback)."""
    inter_bytes_per_s: float
    """Per-GPU, per-direction bandwidth between nodes (the GPU's NIC)."""
    gpus_per_node: int
    source: str
    tune: Tunables = field(default_factory=Tunables)
    sustained_flops: dict[str, float] = field(default_factory=dict)
    """The highest GEMM FLOP/s measured under this device's power limit, by matmul dtype: a ceiling on every GEMM's
    rate where the operation tables were measured on a device of the same die without that limit (empty: none)."""
    cores: int | None = None
    """CPU profile only: cores shared by the ranks (more ranks than cores time-share them)."""
    calibration_id: int | None = None
    gemm_curve: tuple[tuple[float, float], ...] = ()
    """Measured (FLOPs of one GEMM, fraction of peak) by size, ascending (CPU probe's gemm_flops_by_size); empty:
    the saturating eff(F) of compute.gemm_s."""
    tables: OpTables = field(default_factory=OpTables)
    provenance: dict[str, str] = field(default_factory=dict)
    """Where each value comes from: the datasheet, a measurement, a publication (by value or table name)."""
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    """Seconds already computed on this profile (compute.py, by their inputs); a changed profile starts empty."""
    arch: str = ""
    """GPU generation (sm80 Ampere, sm90 Hopper, sm100 Blackwell, cdna3 AMD; hardware.json "arch"); empty: read from
    the name (`device_class`)."""

    @property
    def device_class(self) -> str:
        """What a stack's defaults depend on (spec/stacks.DEVICE_CLASSES): cpu, the GPU generation, or gpu."""
        if self.kind == CPU:
            return "cpu"
        if self.arch in DEVICE_CLASSES:
            return self.arch
        name = f"{self.key} {self.name}".upper()
        for marks, arch in ((("H100", "H200", "GH100", "GH200"), "sm90"), (("A100", "A10", "A30", "A40"), "sm80"),
                            (("B200", "B100", "GB200", "B300"), "sm100"), (("MI300",), "cdna3")):
            if any(m in name for m in marks):
                return arch
        return "gpu"

    def peak(self, precision: str) -> float:
        """Peak FLOP/s of the matmul dtype: bf16/fp16 mixed precision runs GEMMs in 16 bit; fp8 runs everything but
        its float8 linears in bf16 (those: `linear_peak`), and MFU is quoted against bf16's peak, as torchtitan does."""
        dtype = {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp8": "bf16"}.get(str(precision), "fp32")
        return self.peak_flops.get(dtype) or self.peak_flops["fp32"]

    def linear_peak(self, precision: str) -> float:
        """Peak FLOP/s for a float8 linear's GEMM under fp8: the profile's fp8 peak, bf16's where it has none
        (`peak_note` says so); other precisions: `peak`."""
        if str(precision) != "fp8":
            return self.peak(precision)
        return self.peak_flops.get("fp8") or self.peak("fp8")

    def peak_note(self, precision: str) -> str | None:
        """What fp8's float8 GEMMs are timed with when the profile has no fp8 peak or no fp8 efficiency (an fp8 GEMM
        table or tune.gemm_fp8_efficiency_max), else None."""
        if str(precision) != "fp8":
            return None
        fp8_efficiency = self.tables.gemm_table("fp8") is not None or self.tune.gemm_fp8_efficiency_max
        missing = [what for what, ok in (("fp8 peak", self.peak_flops.get("fp8")),
                                         ("fp8 GEMM efficiency", fp8_efficiency)) if not ok]
        if not missing:
            return None
        return (f"{self.key}: no {' / '.join(missing)} in the profile: float8 GEMMs timed with bf16's "
                f"({self.peak('fp8') / 1e12:.0f} TFLOP/s peak, efficiency {self.tune.gemm_efficiency_max})"
                if len(missing) == 2 else f"{self.key}: no {missing[0]} in the profile: bf16's used for float8 GEMMs")

    def peak_of(self, dtype: str) -> float:
        """Dense peak FLOP/s of a matmul dtype (bf16, fp16, fp8, fp32); fp16 falls back to bf16, others to fp32."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        if dtype == "fp16" and "bf16" in self.peak_flops:
            return self.peak_flops["bf16"]
        if dtype == "fp8":
            raise ValueError(f"hardware profile {self.key!r} has no fp8 peak (peak_flops.fp8)")
        return self.peak_flops["fp32"]

    def with_tunables(self, **changes: float) -> Hardware:
        known = {f.name for f in fields(Tunables)}
        return replace(self, tune=replace(self.tune, **{k: v for k, v in changes.items() if k in known}), memo={})

    def elementwise_fraction(self, cls: str) -> float:
        """Achieved / peak HBM bandwidth of a memory-bound kernel of class `cls` (op_tables.ELEMENTWISE_CLASSES),
        calibration scale included."""
        t = self.tables.elementwise
        base = t.get(cls) or t.get("copy") or self.tune.memory_efficiency
        return base * self.tune.elementwise_scale

    def to_dict(self) -> dict[str, Any]:
        """The profile as `hardware --json` lists it: values, tunables, provenance and a summary of each table."""
        d = {f.name: getattr(self, f.name) for f in fields(self)
             if f.name not in ("tune", "gemm_curve", "tables", "memo")}
        d["tune"] = {f.name: getattr(self.tune, f.name) for f in fields(Tunables)}
        d["tables"] = tables_summary(self.tables)
        return d


def tables_summary(t: OpTables) -> dict[str, Any]:
    """Sizes, headline values and sources of a profile's tables (the full tables: op_tables.table_json)."""
    out: dict[str, Any] = {}
    if t.gemm:
        out["gemm"] = {d: {"rows": len(g.rows), "max_efficiency": max(r[3] for r in g.rows), "source": g.source}
                       for d, g in t.gemm.items()}
    if t.attention:
        out["attention"] = {"kernels": list(t.attention.kernels()), "rows": len(t.attention.rows),
                            "source": t.attention.source}
    full = table_json(t)
    for part in ("elementwise", "optimizer", "overhead"):
        if part in full:
            out[part] = full[part]
    return out

def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read hardware profiles from {path}: {e}") from e


def _build(key: str, entry: dict[str, Any], defaults: dict[str, Any],
           kind_defaults_by: dict[str, dict[str, Any]]) -> Hardware:
    known = {f.name for f in fields(Tunables)}
    kind_defaults = kind_defaults_by.get(entry.get("kind", "gpu"), {})
    need = ("name", "peak_flops", "hbm_bytes_per_s", "intra_bytes_per_s", "inter_bytes_per_s")
    missing = [k for k in need if k not in entry]
    if missing:
        raise ValueError(f"hardware profile {key!r} lacks {', '.join(missing)}")
    tables = _tables(key, entry)
    measured_floor = {"kernel_launch_s": tables.kernel_s} if tables.kernel_s else {}
    tune = Tunables(**{k: float(v) for k, v in {**defaults, **kind_defaults, **measured_floor,
                                                **entry.get("tune", {})}.items()
                       if k in known})
    provenance = {**{k: v for k, v in entry.get("provenance", {}).items() if isinstance(v, str)},
                  **{f"tables.{k}": v for k, v in tables.sources.items()}}
    return Hardware(key=key, name=entry["name"], kind=entry.get("kind", "gpu"),
                    memory_bytes=float(entry.get("memory_bytes", 0)),
                    peak_flops={k: float(v) for k, v in entry["peak_flops"].items()},
                    sustained_flops={k: float(v) for k, v in entry.get("sustained_flops", {}).items()},
                    hbm_bytes_per_s=float(entry["hbm_bytes_per_s"]),
                    intra_bytes_per_s=float(entry["intra_bytes_per_s"]),
                    inter_bytes_per_s=float(entry["inter_bytes_per_s"]),
                    gpus_per_node=int(entry.get("gpus_per_node", 8)), source=entry.get("source", ""), tune=tune,
                    cores=entry.get("cores"), gemm_curve=_curve(entry), tables=tables, provenance=provenance,
                    arch=str(entry.get("arch", "")))


@lru_cache(maxsize=1)
def named_tables() -> dict[str, Any]:
    """op_tables.json's named tables."""
    return _read(TABLES_FILE)["tables"]


def _tables(key: str, entry: dict[str, Any]) -> OpTables:
    """A profile's operation tables: its `tables` entry (each part a table name of op_tables.json or the part
    itself; gemm by dtype), else the GPU probe's `measured` tables, else none."""
    spec = entry.get("tables")
    if spec:
        resolved: dict[str, Any] = {}
        for part, ref in spec.items():
            if part == "gemm":
                resolved["gemm"] = {d: _named(key, r, "gemm")[d] if isinstance(r, str) else r for d, r in ref.items()}
            elif part == "attention" and isinstance(ref, list):
                resolved[part] = merged_attention_tables(key,
                                                         [_named(key, r, part) if isinstance(r, str) else r
                                                          for r in ref])
            else:
                resolved[part] = _named(key, ref, part) if isinstance(ref, str) else ref
        return tables_from_json(resolved)
    measured = entry.get("measured") or {}
    if entry.get("kind", "gpu") != CPU and any(measured.get(k) for k in ("gemm_bf16", "attention", "elementwise")):
        return tables_from_measured(measured, {k: float(v) for k, v in entry["peak_flops"].items()},
                                    float(entry["hbm_bytes_per_s"]), f"measured: {entry.get('source', key)}")
    return OpTables()


def merged_attention_tables(key: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Several attention tables as one (`"attention": [name, ...]`): each kernel from exactly one of them."""
    seen: set[str] = set()
    for part in parts:
        kernels = {r["kernel"] for r in part["rows"]}
        if kernels & seen:
            raise ValueError(f"hardware profile {key!r}: attention kernels {sorted(kernels & seen)} in two of its "
                             "tables")
        seen |= kernels
    return {"rows": [r for part in parts for r in part["rows"]],
            "source": "; ".join(part.get("source", "") for part in parts)}


def _named(key: str, name: str, part: str) -> Any:
    table = named_tables().get(name, {}).get(part)
    if table is None:
        raise ValueError(f"hardware profile {key!r}: op_tables.json has no {part} table {name!r}")
    return table


def _curve(entry: dict[str, Any]) -> tuple[tuple[float, float], ...]:
    """The probe's GEMM FLOP/s by size as (FLOPs, fraction of the fp32 peak), ascending by size."""
    rows = entry.get("measured", {}).get("gemm_flops_by_size") or []
    peak = float(entry["peak_flops"].get("fp32") or 0)
    if not peak:
        return ()
    return tuple(sorted((float(f), float(r) / peak) for f, r in rows if f > 0 and r > 0))


def cpu_profile_path() -> Path:
    return Path(os.environ.get("SHARDLAB_CPU_PROFILE") or CPU_PROFILE_FILE)


def load_profiles() -> dict[str, Hardware]:
    """Every profile: shipped, then $SHARDLAB_HARDWARE's, then the measured CPU profile if the probe ran."""
    base = _read(DATA_FILE)
    sections = ("defaults", "cpu_defaults", "gpu_defaults")
    found = {s: {k: v for k, v in base.get(s, {}).items() if not k.startswith("_")} for s in sections}
    entries = dict(base["profiles"])
    user = os.environ.get("SHARDLAB_HARDWARE")
    if user:
        extra = _read(Path(user))
        for s in sections:
            found[s].update({k: v for k, v in extra.get(s, {}).items() if not k.startswith("_")})
        entries.update(extra.get("profiles", {}))
    cpu = cpu_profile_path()
    if cpu.exists():
        entries[CPU] = _read(cpu)
    by_kind = {CPU: found["cpu_defaults"], "gpu": found["gpu_defaults"]}
    return {k: _build(k, v, found["defaults"], by_kind) for k, v in entries.items()}


def get_hardware(key: str) -> Hardware:
    """One profile by key; the error lists the known keys (and how to make the CPU one)."""
    profiles = load_profiles()
    if key not in profiles:
        hint = " (run `python -m backend.bench.hw_probe` to measure this machine)" if key == CPU else ""
        raise ValueError(f"unknown hardware {key!r}{hint}; known: {', '.join(sorted(profiles))}")
    return profiles[key]
