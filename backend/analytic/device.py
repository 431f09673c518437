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
- RMSNorm runs one fused kernel on CUDA and a chain of fp32 ops on the CPU, which save different tensors:
  `rms_norm_saved_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backend.spec.choices import Optimizer

if TYPE_CHECKING:
    from backend.analytic.layout import Layout
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ExperimentSpec, ParallelSpec

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


FP32_BYTES = 4
"""RMSNorm's rstd and the CPU composite's op-math values are fp32."""


def rms_norm_saved_bytes(*, sbh: float, sb: float, input_bytes: float, device: str) -> float:
    """Bytes one nn.RMSNorm (F.rms_norm with a weight of the input's dtype) keeps for backward, for sbh input
    elements in sb rows. torch 2.11 / 2.13 `rms_norm` calls `_fused_rms_norm`, whose kernels are registered for
    CUDA, MPS and XPU only; on the CPU its CompositeImplicitAutograd kernel `rms_norm_composite` runs instead
    (aten/src/ATen/native/native_functions.yaml, aten/src/ATen/native/layer_norm.cpp):
    - cuda: `_fused_rms_norm_cuda`, whose autograd formula (tools/autograd/derivatives.yaml `_fused_rms_norm`) keeps
      the input as it came (input_bytes: the fp32 residual stream under autocast, bf16 under FSDP2's bf16 params),
      the weight and the fp32 rstd (rows, 1): sbh·input_bytes + 4·sb;
    - cpu: the composite computes in the op-math type, fp32 (a 16-bit input is upcast first, `input.to(opmath_t)`):
      pow and mul keep the fp32 input, rsqrt its fp32 output, the weight mul the fp32 normalised x:
      4·(2·sbh + sb) whatever the input dtype.
    Measured (benchmarks/results/gpu/2026-11-26-h200-run2 report.json diag.saved_tensors, H200, torch 2.11): CUDA
    FusedRmsNormBackward0 keeps x (fp32 / bf16) and a float32 (1, s, 1) rstd; the CPU listing keeps
    ToCopyBackward0 / RsqrtBackward0 / MulBackward0 tensors, all float32, in both modes."""
    if device == CUDA:
        return sbh * input_bytes + FP32_BYTES * sb
    return FP32_BYTES * (2 * sbh + sb)


def with_device(spec: ExperimentSpec, device: str | None) -> ExperimentSpec:
    """The spec with runtime.device resolved to "cpu"/"cuda": `device` when the caller knows where the ranks run
    (the engine: its ctx.device; a UI/CLI host: backend.engine.device_facts.host_device), else
    spec.runtime.device with `auto` read as a host without CUDA."""
    dev = device or resolve_device(str(spec.runtime.device), cuda_available=False)
    if str(spec.runtime.device) == dev:
        return spec
    device_type = type(spec.runtime.device)  # the spec's own enum: a str there warns on every dump
    return spec.model_copy(update={"runtime": spec.runtime.model_copy(update={"device": device_type(dev)})})


def device_notes(spec: ExperimentSpec, *, n_param_tensors: int, autocast: bool) -> list[str]:
    """What the CUDA prediction does differently (none for cpu)."""
    if str(spec.runtime.device) != CUDA:
        return []
    notes = ["CUDA: every parameter, gradient and optimizer-state storage is predicted rounded up to 512 B "
             "(the caching allocator's block, as MemTracker counts it), except gradients that are views of one "
             "buffer (classic DDP's buckets, FSDP2's per-unit reduce-scatter output)"]
    if spec.train.optimizer == Optimizer.ADAMW:
        notes.append(f"CUDA: AdamW's 0-dim `step` tensors (4 B per local parameter tensor, ≤ {4 * n_param_tensors:,} "
                     "B) live on the host (capturable=False), so they are not in the device's optimizer bytes")
    if autocast and str(spec.train.recompute) == "none":
        notes.append("CUDA autocast runs softmax in fp32: the attention probabilities are saved in fp32 and again as "
                     "the 16-bit copy probs @ v saves (6 B per score instead of 2 B on CPU)")
    if str(getattr(spec.model, "norm", "layernorm")) == "rmsnorm":
        notes.append("CUDA: RMSNorm runs torch's fused kernel, which keeps only its input and an fp32 rstd per row for "
                     "backward (the CPU composite also keeps an fp32 normalised copy, and an fp32 copy of a 16-bit "
                     "input)")
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

    cuda_context_bytes: int = 527 * MiB
    """The CUDA context per process, outside the caching allocator (not in torch.cuda.max_memory_reserved): measured
    on the H200 (benchmarks/results/gpu/2026-11-26-h200-run{1,2} env.torch: memory_bytes - memory_free_bytes right
    after CUDA initialisation = 552,402,944 B = 526.8 MiB; driver 580, CUDA 13.0, torch 2.11). Other drivers and
    GPUs differ (commonly 300-800 MiB); cuBLAS workspaces come from the caching allocator (counted in reserved)."""
    nccl_channels: int = 8
    """NCCL channels per communicator (topology dependent, NCCL_MIN/MAX_NCHANNELS)."""
    nccl_peers: int = 2
    """Ring neighbours each channel keeps buffers for (send + receive side)."""
    nccl_buffsize_bytes: int = NCCL_BUFFSIZE_BYTES
    """NCCL_BUFFSIZE per channel and peer (Simple protocol)."""
    fragmentation_frac: float = 0.13
    """Caching-allocator slack (reserved - allocated) as a fraction of the predicted fullest moment: 0.13 covers the
    largest measured on the H200 (2026-11-26 runs 1 and 2, Llama-3.2-1B shape at seq 4096, world 1, torch 2.11 default
    allocator, expandable_segments off): peak reserved over the predicted fullest moment (= the tracked peak, and
    0.2% under peak allocated) +6.1% ddp, +7.1% zero2, +9.7% zero3 and zero3-selective, +13.0% zero3-full (its
    backward re-runs each block, churning the pool), e.g. zero3 33.27 GiB reserved vs 30.40 allocated. Was 10%
    (assumed); the zero3-full run needed more."""

    def nccl_bytes_per_communicator(self) -> int:
        return self.nccl_channels * self.nccl_peers * self.nccl_buffsize_bytes


def communicators(parallel: ParallelSpec | Layout) -> Num:
    """NCCL communicators one rank creates: the world, each mesh dimension of size > 1, and under PP the two
    point-to-point pairs with the neighbouring stages (ProcessGroupNCCL creates one per send/recv peer). `parallel`:
    a spec's ParallelSpec (an int) or the planner's Layout of many layouts (an array, one count per layout)."""
    p = parallel
    world = np.asarray(p.world_size)
    dims = sum(np.logical_and(np.asarray(d) > 1, np.asarray(d) != world).astype(np.int64)
               for d in (p.dp_cp, p.tp, p.pp, p.ep, p.cp))
    n = np.where(world <= 1, 0, 1 + dims + 2 * (np.asarray(p.pp) > 1))
    return int(n) if np.ndim(n) == 0 else n


def profile_device(kind: str) -> str:
    """Where a hardware profile's ranks run: CUDA ranks on a GPU profile, CPU ranks on a "cpu" one (what `estimate
    --hardware`'s fit and the planner both price a layout on)."""
    return CPU if str(kind) == CPU else CUDA


def allowance_bytes(fullest_bytes: Num, parallel: ParallelSpec | Layout | None, device: str,
                    overhead: RuntimeOverhead | None = None) -> dict[str, Any]:
    """{cuda_context, nccl_buffers, fragmentation, total}: the runtime allowance of ranks whose fullest moment is
    fullest_bytes (a number, or one per layout of the planner's arrays); all zero on cpu (the tracker's bytes are what
    the host allocator hands out). The one "does it fit" rule (`fits_device`) adds it to the fullest moment.
    `parallel` None: a row without its layout (New experiment's cpu ranks), read only on cuda."""
    o = overhead or RuntimeOverhead()
    if str(device) != CUDA:
        return {"cuda_context": 0.0, "nccl_buffers": 0.0, "fragmentation": 0.0, "total": 0.0}
    parts = {"cuda_context": float(o.cuda_context_bytes),
             "nccl_buffers": communicators(parallel) * float(o.nccl_bytes_per_communicator()),
             "fragmentation": o.fragmentation_frac * (np.asarray(fullest_bytes, dtype=np.float64)
                                                      if np.ndim(fullest_bytes) else float(fullest_bytes))}
    parts["total"] = parts["cuda_context"] + parts["nccl_buffers"] + parts["fragmentation"]
    return parts


def need_bytes(fullest_bytes: Num, parallel: ParallelSpec | Layout | None, device: str,
               overhead: RuntimeOverhead | None = None) -> Num:
    """Device memory a rank needs: its fullest moment + the runtime allowance (allowance_bytes)."""
    return fullest_bytes + allowance_bytes(fullest_bytes, parallel, device, overhead)["total"]


def fits_device(fullest_bytes: Num, parallel: ParallelSpec | Layout | None, device: str, device_bytes: float,
                overhead: RuntimeOverhead | None = None) -> Num:
    """The one "does it fit" rule: need_bytes <= the device's memory (a device of unknown memory fits nothing).
    `estimate --hardware`'s fit line, the planner's filter, its why-#1 walk, the Plan page, New experiment's fit check
    (dashboard/predict_view.fit_check) and the GPU check's memory_fit call it.
    Its terms (RuntimeOverhead) are measured (context, allocator slack: the H200 runs) or documented (NCCL_BUFFSIZE),
    where the planner's former budget (device x 0.95 - 2.5 GB) was assumed."""
    return np.logical_and(bool(device_bytes), need_bytes(fullest_bytes, parallel, device, overhead) <= device_bytes)


FITS, TIGHT, DOES_NOT_FIT = "fits", "tight", "does not fit"
TIGHT_REASON = ("the tensors, CUDA context and NCCL buffers fit; the allocator slack is the reserve measured without "
                "memory pressure, and under pressure PyTorch frees its cached blocks and retries before an "
                "out-of-memory error, less fragmented with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: it may "
                "run")
"""Why a TIGHT layout may run, in the words `estimate` and New experiment show."""


def fit_verdict(fullest_bytes: float, parallel: ParallelSpec | Layout | None, device: str, device_bytes: float,
                overhead: RuntimeOverhead | None = None) -> str:
    """FITS (fits_device), DOES_NOT_FIT (even the fullest moment + the CUDA context and NCCL buffers exceed the device),
    or TIGHT in between: only the allocator slack does not fit. The slack is the reserve measured without memory
    pressure; under pressure the caching allocator frees its cached blocks that are not split and retries before it
    reports out of memory (c10/cuda/CUDACachingAllocator.cpp malloc: release_available_cached_blocks, then
    release_cached_blocks), and with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True the free blocks it releases are
    unmapped pages of one growing segment, so a tight layout may run: how much of the slack it needs has not been
    measured."""
    if fits_device(fullest_bytes, parallel, device, device_bytes, overhead):
        return FITS
    fixed = allowance_bytes(fullest_bytes, parallel, device, overhead)
    without_slack = fullest_bytes + fixed["cuda_context"] + fixed["nccl_buffers"]
    return TIGHT if device_bytes and without_slack <= device_bytes else DOES_NOT_FIT


def fullest_budget_bytes(parallel: ParallelSpec | Layout, device: str, device_bytes: float,
                         overhead: RuntimeOverhead | None = None) -> Num:
    """The largest fullest moment that fits (fits_device solved for it), in words for the Plan page: the device less
    the CUDA context and NCCL buffers, over 1 + the allocator slack; the device itself on cpu."""
    o = overhead or RuntimeOverhead()
    fixed = allowance_bytes(0.0, parallel, device, o)
    if str(device) != CUDA:
        return float(device_bytes)
    return (device_bytes - fixed["cuda_context"] - fixed["nccl_buffers"]) / (1 + o.fragmentation_frac)


def runtime_overhead_bytes(spec: ExperimentSpec, peak_bytes: float,
                           overhead: RuntimeOverhead | None = None) -> dict[str, float]:
    """{cuda_context, nccl_buffers, fragmentation, total} bytes for one rank of a spec whose predicted peak is
    peak_bytes (allowance_bytes on the spec's device)."""
    return {k: float(v) for k, v in allowance_bytes(peak_bytes, spec.parallel, str(spec.runtime.device),
                                                    overhead).items()}
