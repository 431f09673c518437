"""Model-state memory per data-parallel rank under ZeRO stages 0-3 (pure Python).

Source: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", Sec 3.1 (mixed-precision Adam: 2Ψ + 2Ψ + KΨ with K = 12) and Sec 5 / Figure 1 (per-stage
memory). Ψ = parameter count, N = data-parallel degree, K = optimizer bytes per parameter.
"""

from __future__ import annotations

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "fp8")
"""fp8 = float8 linears over bf16 mixed precision: its model states are 16-bit mixed precision's (the float8 copies
of weights and activations are made per matmul, not kept: torchao dynamic scaling)."""
OPTIMIZERS = ("adamw", "sgd")


def precision_bytes(precision: str, optimizer: str) -> tuple[int, int, int]:
    """(param_bytes, grad_bytes, optimizer_bytes_per_param) for one parameter."""
    precision, optimizer = str(precision), str(optimizer)
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} not in {PRECISIONS}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} not in {OPTIMIZERS}")
    n_states = 2 if optimizer == "adamw" else 1  # Adam keeps m and v; SGD with momentum keeps one buffer
    if precision == "fp32":
        return 4, 4, 4 * n_states  # ZeRO Sec 3.1: fp32 Adam m and v are 4 bytes each; no master copy needed in fp32
    # ZeRO Sec 3.1: 16-bit params/grads; fp32 master copy (4) + fp32 states (4 each): K = 12 for Adam
    return 2, 2, 4 + 4 * n_states


def zero_model_state_bytes(
    psi: float, *, n: int, stage: int, k: float = 12, param_bytes: float = 2, grad_bytes: float = 2
) -> dict[str, float]:
    """Per-rank bytes of params, grads and optimizer state at ZeRO `stage` over `n` ranks."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if n < 1:
        raise ValueError(f"data-parallel degree n must be >= 1, got {n}")
    params = param_bytes * psi / (n if stage >= 3 else 1)  # ZeRO Sec 5.3 (P_os+g+p): params sharded
    grads = grad_bytes * psi / (n if stage >= 2 else 1)  # ZeRO Sec 5.2 (P_os+g): grads sharded
    optim = k * psi / (n if stage >= 1 else 1)  # ZeRO Sec 5.1 (P_os): optimizer states sharded
    return {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": optim,
            "total_bytes": params + grads + optim}


def zero_memory_reduction(*, n: int, stage: int, k: float = 12, param_bytes: float = 2,
                          grad_bytes: float = 2) -> float:
    """Stage-0 bytes over stage-`stage` bytes (ZeRO Sec 5 / Figure 1: 4x, 8x, N as N grows, K=12)."""
    base = zero_model_state_bytes(1.0, n=n, stage=0, k=k, param_bytes=param_bytes, grad_bytes=grad_bytes)
    cur = zero_model_state_bytes(1.0, n=n, stage=stage, k=k, param_bytes=param_bytes, grad_bytes=grad_bytes)
    return base["total_bytes"] / cur["total_bytes"]
