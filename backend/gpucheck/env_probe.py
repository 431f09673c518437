"""Phase 1 of the GPU check, run in a process of its own (`python -m backend.gpucheck.env_probe --device cuda`,
one JSON object on stdout) so the kit's own process never holds a CUDA context:

- versions: Python, torch, CUDA, cuDNN, NCCL, the driver, and the packages the engine path imports;
- the device: name, SMs, memory, compute capability, L2, clocks and power limit (nvidia-smi, when present);
- the torch APIs the GPU path uses, each present or not (torch 2.11 on the device vs 2.13 here), and whether
  ShardLab's private-API modules import (backend/torch_compat.py, backend/trace/torch_private.py);
- which heavy product dependencies are importable (the engine path must not need them).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from typing import Any

TORCH_APIS = (
    "torch.nn.attention.sdpa_kernel", "torch.nn.attention.SDPBackend.CUDNN_ATTENTION",
    "torch.nn.attention.SDPBackend.FLASH_ATTENTION", "torch._scaled_mm", "torch.float8_e4m3fn",
    "torch.nn.functional.rms_norm", "torch.distributed.fsdp.fully_shard", "torch.distributed.fsdp.CPUOffloadPolicy",
    "torch.distributed.fsdp.MixedPrecisionPolicy", "torch.distributed.device_mesh.init_device_mesh",
    "torch.distributed.device_mesh.DeviceMesh._unflatten", "torch.distributed._tools.mem_tracker.MemTracker",
    "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker", "torch.distributed.tensor.parallel.loss_parallel",
    "torch.distributed.pipelining.ScheduleDualPipeV", "torch.distributed._composable.replicate_with_fsdp.replicate",
    "torch.distributed.distributed_c10d._resolve_process_group", "torch.cuda.Event",
    "torch.utils.checkpoint.create_selective_checkpoint_contexts",
)
PRODUCT_MODULES = ("backend.torch_compat", "backend.trace.torch_private", "backend.engine.rank",
                   "backend.launch.launcher", "backend.frameworks.assemblers")
PACKAGES = ("torch", "numpy", "psutil", "pydantic", "pydantic_core", "annotated_types", "typing_extensions",
            "typing_inspection", "pytest", "pytest_timeout", "transformers", "sqlalchemy", "streamlit", "plotly",
            "pandas")
NVIDIA_SMI_FIELDS = ("name", "driver_version", "memory.total", "clocks.max.sm", "clocks.max.memory", "power.limit",
                     "pci.bus_id")


def resolve(dotted: str) -> Any:
    """The object a dotted path names (module attributes walked one by one); raises when any part is missing."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for attr in parts[k:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no module in {dotted!r}")


def api_presence(names: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for name in names:
        try:
            resolve(name)
            out[name] = "ok"
        except Exception as e:  # noqa: BLE001 - every missing symbol is reported by name
            out[name] = f"missing: {type(e).__name__}: {str(e)[:200]}"
    return out


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                           "executable": sys.executable, "cpu_count": os.cpu_count()}
    for pkg in PACKAGES:
        try:
            out[pkg] = metadata.version(pkg.replace("_", "-"))
        except metadata.PackageNotFoundError:
            out[pkg] = None if importlib.util.find_spec(pkg) is None else "importable (no metadata)"
    return out


def nvidia_smi(timeout_s: float = 15.0) -> dict[str, Any]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return {"error": "nvidia-smi not found"}
    try:
        proc = subprocess.run([exe, f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    rows = [dict(zip(NVIDIA_SMI_FIELDS, (v.strip() for v in line.split(",")),
                     strict=False)) for line in proc.stdout.splitlines()
            if line.strip()]
    return {"gpus": rows, "returncode": proc.returncode, "stderr": proc.stderr[-500:]}


def torch_facts(device: str) -> dict[str, Any]:
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "cuda_build": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available(), "gpu_count": torch.cuda.device_count()}
    if device != "cuda" or not torch.cuda.is_available():
        from backend.bench.env import cpu_name

        out["device_name"] = cpu_name()
        return out
    props = torch.cuda.get_device_properties(0)
    out.update(device_name=torch.cuda.get_device_name(0), memory_bytes=int(props.total_memory),
               sm_count=int(props.multi_processor_count), compute_capability=f"{props.major}.{props.minor}",
               l2_cache_bytes=int(getattr(props, "L2_cache_size", 0) or 0),
               cudnn=torch.backends.cudnn.version(), devices=[torch.cuda.get_device_name(i)
                                                             for i in range(torch.cuda.device_count())])
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001
        out["nccl"] = f"unavailable ({type(e).__name__})"
    free, total = torch.cuda.mem_get_info(0)
    out.update(memory_free_bytes=int(free), flash_sdp_enabled=torch.backends.cuda.flash_sdp_enabled(),
               cudnn_sdp_enabled=torch.backends.cuda.cudnn_sdp_enabled())
    return out


def collect(device: str) -> dict[str, Any]:
    out: dict[str, Any] = {"versions": versions()}
    for name, fn in (("torch", lambda: torch_facts(device)), ("apis", lambda: api_presence(TORCH_APIS)),
                     ("product_imports", lambda: api_presence(PRODUCT_MODULES)),
                     ("nvidia_smi", nvidia_smi if device == "cuda" else lambda: {"skipped": "device cpu"})):
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - one section failing leaves the others
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    heavy = ("sqlalchemy", "streamlit", "plotly", "pandas", "typer")
    out["heavy_modules_loaded_by_engine_path"] = sorted(m for m in heavy if m in sys.modules)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m backend.gpucheck.env_probe")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    args = ap.parse_args(argv)
    print(json.dumps(collect(args.device), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
