"""Which device a spec's ranks run on, and what that device changes in the prediction (pure Python, no torch).

- `resolve_device`: spec.runtime.device `auto` -> cuda when CUDA is present, else cpu: the rule of
  backend.engine.mesh.pick_backend_device, with the CUDA check passed in by the caller (torch-side code
  calls torch.cuda.is_available(); the analytic layer never imports torch).
- `cuda_storage_bytes`: the CUDA caching allocator hands out blocks in multiples of 512 B
  (c10/cuda/CUDACachingAllocator.cpp kMinBlockSize = 512), and MemTracker rounds every CUDA storage up
  to that (torch/distributed/_tools/mem_tracker.py `_PYTORCH_MIN_ALLOCATE`); CPU storages are exact.
- AdamW's per-parameter `step` is a CPU tensor for CUDA parameters unless capturable/fused
  (torch/optim/adamw.py `_init_group`: `torch.zeros((), dtype=_get_scalar_dtype())` on the default
  device): on CUDA it is host memory, not device memory.
- CUDA autocast casts `softmax` to fp32 (ATen/autocast_mode.h AT_FORALL_FP32_SET_OPT_DTYPE), CPU autocast
  does not: `softmax_saved_bytes_per_score`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CPU, CUDA = "cpu", "cuda"
CUDA_MIN_BLOCK_BYTES = 512  # c10/cuda/CUDACachingAllocator.cpp kMinBlockSize; MemTracker _PYTORCH_MIN_ALLOCATE


def resolve_device(requested: str, *, cuda_available: bool) -> str:
    """"cpu" or "cuda" for spec.runtime.device (auto / cpu / cuda), as the engine resolves it on a host that
    does (cuda_available=True) or does not have CUDA; an explicit cpu or cuda passes through (a prediction for
    cuda needs no GPU; the engine rejects cuda without one before it runs)."""
    requested = str(requested)
    if requested == "auto":
        return CUDA if cuda_available else CPU
    if requested not in (CPU, CUDA):
        raise ValueError(f"device {requested!r} is not one of auto, cpu, cuda")
    return requested


def cuda_storage_bytes(nbytes: float) -> int:
    """Bytes one CUDA storage of `nbytes` occupies (rounded up to 512 B; an empty storage takes nothing)."""
    n = int(nbytes)
    return -(-n // CUDA_MIN_BLOCK_BYTES) * CUDA_MIN_BLOCK_BYTES


def storage_bytes(nbytes_per_tensor: list[float] | tuple[float, ...], device: str) -> int:
    """Sum over tensors, each its own storage, as the engine's tracker counts them on `device`."""
    if device == CUDA:
        return sum(cuda_storage_bytes(b) for b in nbytes_per_tensor)
    return int(sum(nbytes_per_tensor))


def adamw_step_on_device(device: str, *, capturable: bool = False, fused: bool = False) -> bool:
    """Whether AdamW's 0-dim `step` tensors live on the parameters' device (they do on CPU; on CUDA only
    when capturable or fused, which the engine does not set)."""
    return device != CUDA or capturable or fused


def softmax_saved_bytes_per_score(dtype_bytes: float, *, autocast: bool, device: str) -> float:
    """Bytes autograd keeps per attention score for softmax + probs @ v. CUDA autocast runs softmax in fp32
    (ATen/autocast_mode.h AT_FORALL_FP32_SET_OPT_DTYPE): softmax saves its fp32 output and the matmul saves its
    16-bit cast, 4 + 2 B; CPU autocast has no such rule (one 16-bit tensor saved by both, measured: 2 B)."""
    if autocast and device == "cuda":
        return 4 + dtype_bytes
    return dtype_bytes


def with_device(spec: Any, device: str | None) -> Any:
    """The spec with runtime.device resolved to "cpu"/"cuda": `device` when the caller knows where the ranks run
    (the engine: its ctx.device; a UI/CLI host: backend.engine.hardware.host_device), else
    spec.runtime.device with `auto` read as a host without CUDA."""
    dev = device or resolve_device(str(spec.runtime.device), cuda_available=False)
    if str(spec.runtime.device) == dev:
        return spec
    return spec.model_copy(update={"runtime": spec.runtime.model_copy(update={"device": dev})})


def device_notes(spec: Any, *, n_param_tensors: int, autocast: bool) -> list[str]:
    """What the CUDA prediction does differently (none for cpu)."""
    if str(spec.runtime.device) != CUDA:
        return []
    notes = ["CUDA: every parameter, gradient and optimizer-state storage is predicted rounded up to 512 B "
             "(the caching allocator's block, as MemTracker counts it), except gradients that are views of one "
             "buffer (classic DDP's buckets, FSDP2's per-unit reduce-scatter output)"]
    if str(spec.train.optimizer) == "adamw":
        notes.append(f"CUDA: AdamW's 0-dim `step` tensors (4 B per local parameter tensor, ≤ {4 * n_param_tensors:,} B) "
                     "live on the host (capturable=False), so they are not in the device's optimizer bytes")
    if autocast and str(spec.train.recompute) == "none":
        notes.append("CUDA autocast runs softmax in fp32: the attention probabilities are saved in fp32 and again as "
                     "the 16-bit copy probs @ v saves (6 B per score instead of 2 B on CPU)")
    if spec.parallel.pp > 1:
        notes.append("CUDA + PP: the sent stage outputs held per rank (analytic/pipelining.py) are calibrated on gloo, "
                     "whose send Works finish when sent; NCCL keeps a sent tensor until its watchdog retires the Work, "
                     "so a few more may be alive: not yet validated on a GPU")
    return notes


MiB = 2**20
NCCL_BUFFSIZE_BYTES = 4 * MiB  # NCCL docs, environment variables: NCCL_BUFFSIZE default 4194304


@dataclass(frozen=True)
class RuntimeOverhead:
    """Device memory a CUDA rank uses outside the tensors the tracker sees: an allowance for "does it fit",
    never part of the per-category prediction. Every term is an assumption to calibrate against a run's
    `cuda_max_reserved_bytes` on your hardware (driver, CUDA, NCCL versions and topology move them)."""

    cuda_context_bytes: int = 512 * MiB
    """CUDA context + cuBLAS/cuDNN handles and workspaces per process (commonly 300-800 MiB; assumed 512 MiB)."""
    nccl_channels: int = 8
    """NCCL channels per communicator (topology dependent, NCCL_MIN/MAX_NCHANNELS)."""
    nccl_peers: int = 2
    """Ring neighbours each channel keeps buffers for (send + receive side)."""
    nccl_buffsize_bytes: int = NCCL_BUFFSIZE_BYTES
    """NCCL_BUFFSIZE per channel and peer (Simple protocol)."""
    fragmentation_frac: float = 0.10
    """Caching-allocator slack (reserved - allocated) as a fraction of the predicted peak (assumed 10%)."""

    def nccl_bytes_per_communicator(self) -> int:
        return self.nccl_channels * self.nccl_peers * self.nccl_buffsize_bytes


def communicators(parallel: Any) -> int:
    """NCCL communicators one rank creates: the world, each mesh dimension of size > 1, and under PP the two
    point-to-point pairs with the neighbouring stages (ProcessGroupNCCL creates one per send/recv peer)."""
    p = parallel
    if p.world_size <= 1:
        return 0
    dims = [d for d in (p.dp_cp, p.tp, p.pp, p.ep, p.cp) if d > 1 and d != p.world_size]
    return 1 + len(dims) + (2 if p.pp > 1 else 0)


def runtime_overhead_bytes(spec: Any, peak_bytes: float, overhead: RuntimeOverhead | None = None) -> dict[str, float]:
    """{cuda_context, nccl_buffers, fragmentation, total} bytes for one rank whose predicted peak is peak_bytes;
    all zero on cpu (the tracker's bytes are what the host allocator hands out)."""
    o = overhead or RuntimeOverhead()
    if str(spec.runtime.device) != CUDA:
        return {"cuda_context": 0.0, "nccl_buffers": 0.0, "fragmentation": 0.0, "total": 0.0}
    parts = {"cuda_context": float(o.cuda_context_bytes),
             "nccl_buffers": float(communicators(spec.parallel) * o.nccl_bytes_per_communicator()),
             "fragmentation": o.fragmentation_frac * float(peak_bytes)}
    parts["total"] = sum(parts.values())
    return parts
