"""Hardware profiles for the step-time model: the shipped data file, a user file, and this machine's probe.

Profiles come from `hardware.json` beside this module (published datasheet peaks, with their source), then
from the JSON file named by SHARDLAB_HARDWARE (same shape; its entries add to or replace the shipped ones),
then "cpu" from the micro-benchmark backend/bench/hw_probe.py wrote (SHARDLAB_CPU_PROFILE, else
data/hardware_cpu.json). Peak FLOP/s are dense; bandwidths are per GPU and per direction.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

DATA_FILE = Path(__file__).with_name("hardware.json")
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
    """The float8 GEMMs' efficiency under fp8 (0: unmeasured, bf16's gemm_efficiency_max is used: Hardware.peak_note)."""


@dataclass(frozen=True)
class Hardware:
    key: str
    name: str
    kind: str
    """gpu or cpu."""
    memory_bytes: float
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
    cores: int | None = None
    """CPU profile only: cores shared by the ranks (more ranks than cores time-share them)."""
    calibration_id: int | None = None
    gemm_curve: tuple[tuple[float, float], ...] = ()
    """Measured (FLOPs of one GEMM, fraction of peak) by size, ascending (CPU probe's gemm_flops_by_size); empty:
    the saturating eff(F) of compute.gemm_s."""

    def peak(self, precision: str) -> float:
        """Peak FLOP/s of the matmul dtype: bf16/fp16 mixed precision runs GEMMs in 16 bit; fp8 runs everything but
        its float8 linears in bf16 (those: `linear_peak`), and MFU is quoted against bf16's peak, as torchtitan does."""
        dtype = {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp8": "bf16"}.get(str(precision), "fp32")
        return self.peak_flops.get(dtype) or self.peak_flops["fp32"]

    def linear_peak(self, precision: str) -> float:
        """Peak FLOP/s for a float8 linear's GEMM under fp8: the profile's fp8 peak scaled by its fp8 GEMM efficiency
        relative to the 16-bit one (tune.gemm_fp8_efficiency_max), falling back to bf16's peak / efficiency where the
        profile lacks them (`peak_note` says which); other precisions: `peak`."""
        if str(precision) != "fp8":
            return self.peak(precision)
        fp8 = self.peak_flops.get("fp8") or self.peak("fp8")
        ratio = self.tune.gemm_fp8_efficiency_max / self.tune.gemm_efficiency_max if self.tune.gemm_fp8_efficiency_max else 1.0
        return fp8 * ratio

    def peak_note(self, precision: str) -> str | None:
        """What fp8's float8 GEMMs are timed with when the profile has no fp8 peak or fp8 efficiency, else None."""
        if str(precision) != "fp8":
            return None
        missing = [what for what, ok in (("fp8 peak", self.peak_flops.get("fp8")),
                                         ("fp8 GEMM efficiency", self.tune.gemm_fp8_efficiency_max)) if not ok]
        if not missing:
            return None
        return (f"{self.key}: no {' / '.join(missing)} in the profile: float8 GEMMs timed with bf16's "
                f"({self.peak('fp8') / 1e12:.0f} TFLOP/s peak, efficiency {self.tune.gemm_efficiency_max})"
                if len(missing) == 2 else f"{self.key}: no {missing[0]} in the profile: bf16's used for float8 GEMMs")

    def with_tunables(self, **changes: float) -> Hardware:
        known = {f.name for f in fields(Tunables)}
        return replace(self, tune=replace(self.tune, **{k: v for k, v in changes.items() if k in known}))

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("tune", "gemm_curve")}
        d["tune"] = {f.name: getattr(self.tune, f.name) for f in fields(Tunables)}
        return d


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read hardware profiles from {path}: {e}") from e


def _build(key: str, entry: dict[str, Any], defaults: dict[str, Any], cpu_defaults: dict[str, Any]) -> Hardware:
    known = {f.name for f in fields(Tunables)}
    kind_defaults = cpu_defaults if entry.get("kind") == CPU else {}
    tune = Tunables(**{k: float(v) for k, v in {**defaults, **kind_defaults, **entry.get("tune", {})}.items() if k in known})
    need = ("name", "peak_flops", "hbm_bytes_per_s", "intra_bytes_per_s", "inter_bytes_per_s")
    missing = [k for k in need if k not in entry]
    if missing:
        raise ValueError(f"hardware profile {key!r} lacks {', '.join(missing)}")
    return Hardware(key=key, name=entry["name"], kind=entry.get("kind", "gpu"), memory_bytes=float(entry.get("memory_bytes", 0)),
                    peak_flops={k: float(v) for k, v in entry["peak_flops"].items()},
                    hbm_bytes_per_s=float(entry["hbm_bytes_per_s"]), intra_bytes_per_s=float(entry["intra_bytes_per_s"]),
                    inter_bytes_per_s=float(entry["inter_bytes_per_s"]), gpus_per_node=int(entry.get("gpus_per_node", 8)),
                    source=entry.get("source", ""), tune=tune, cores=entry.get("cores"), gemm_curve=_curve(entry))


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
    defaults = {k: v for k, v in base.get("defaults", {}).items() if not k.startswith("_")}
    cpu_defaults = {k: v for k, v in base.get("cpu_defaults", {}).items() if not k.startswith("_")}
    entries = dict(base["profiles"])
    user = os.environ.get("SHARDLAB_HARDWARE")
    if user:
        extra = _read(Path(user))
        defaults.update({k: v for k, v in extra.get("defaults", {}).items() if not k.startswith("_")})
        cpu_defaults.update({k: v for k, v in extra.get("cpu_defaults", {}).items() if not k.startswith("_")})
        entries.update(extra.get("profiles", {}))
    cpu = cpu_profile_path()
    if cpu.exists():
        entries[CPU] = _read(cpu)
    return {k: _build(k, v, defaults, cpu_defaults) for k, v in entries.items()}


def get_hardware(key: str) -> Hardware:
    """One profile by key; the error lists the known keys (and how to make the CPU one)."""
    profiles = load_profiles()
    if key not in profiles:
        hint = " (run `python -m backend.bench.hw_probe` to measure this machine)" if key == CPU else ""
        raise ValueError(f"unknown hardware {key!r}{hint}; known: {', '.join(sorted(profiles))}")
    return profiles[key]
