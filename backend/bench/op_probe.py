"""The operation tables of a device: what one GPU (or, with tiny sizes, the CPU) achieves on the operations a
transformer training step is made of, keyed by shape.

- `gemm`: FLOP/s by (M, K, N) for the QKV, out-projection and MLP GEMMs of hidden sizes h, tensor-parallel
  degrees tp and tokens per microbatch T: forward (M=T, K=h or h/tp, N) and weight-gradient (M=K_fwd, K=T, N)
  shapes, in bf16, and fp8 (e4m3 operands, bf16 output) through `torch._scaled_mm` where it runs, with one scale
  per operand (`gemm_fp8`) and one per row (`gemm_fp8_rowwise`, torchao's rowwise recipe);
- `attention`: SDPA forward and backward seconds and FLOP/s by (batch, seq, heads, head_dim, causal) per kernel
  (flash, efficient, cuDNN via `torch.nn.attention.sdpa_kernel`); FLOPs as FlashAttention-2 counts them
  (Dao 2023, Sec 4.1: forward 4·b·a·s²·d, halved when causal; backward 2.5x forward);
- `elementwise`: bytes/s of copy, RMSNorm, LayerNorm, SwiGLU, GELU (forward) and cross-entropy (forward +
  backward, fp32 logits as the engine's loss computes) at large vocabularies; bytes = the minimum a kernel must
  read and write;
- `optimizer`: AdamW step throughput, fused and foreach implementations;
- `launch`: seconds per tiny kernel, on the device (queue saturated) and on the host (launch call);
- `host_copy`: pinned host<->device copy bandwidth (what parameter/optimizer offload moves each step).

Every measurement is `op_timing.median_s` (device time, warm-up, median, rotated random inputs); a failing
shape or kernel is a row with `error` instead of numbers, never an exception out of the table.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from backend.bench.op_timing import Deadline, median_s, randn, rotation_count, synchronize

GEMM_KINDS = {"qkv": (1, 3, "n"), "out_proj": (1, 1, "k"), "mlp_in": (1, 4, "n"), "mlp_out": (4, 1, "k")}
"""(K, N) of the forward GEMM in units of h (ffn = 4h, MHA), and which of them tensor parallelism divides by tp
(Megatron: column-parallel QKV and MLP-in split N, row-parallel out-projection and MLP-out split K)."""
ROTATE_BUDGET_BYTES = 2 * 2**30


@dataclass(frozen=True)
class Sizes:
    """The grid of one probe: full (a GPU) or tiny (the CPU test suite runs the same code)."""

    hidden: tuple[int, ...]
    tp: tuple[int, ...]
    tokens: tuple[int, ...]
    fp8_tokens: tuple[int, ...]
    attn_seq: tuple[int, ...]
    attn_heads: tuple[int, ...]
    attn_head_dim: tuple[int, ...]
    attn_tokens: int
    norm_tokens: int
    norm_hidden: tuple[int, ...]
    ce_tokens: int
    ce_vocab: tuple[int, ...]
    adam_tensors: int
    adam_numel_per_tensor: int
    launch_count: int
    copy_bytes: int


FULL = Sizes(hidden=(2048, 4096, 8192, 16384), tp=(1, 2, 4, 8), tokens=(2048, 8192, 32768), fp8_tokens=(8192,),
             attn_seq=(1024, 4096, 16384), attn_heads=(16, 32), attn_head_dim=(64, 128), attn_tokens=16384,
             norm_tokens=16384, norm_hidden=(4096, 8192), ce_tokens=8192, ce_vocab=(32000, 128256),
             adam_tensors=64, adam_numel_per_tensor=4 * 2**20, launch_count=2000, copy_bytes=256 * 2**20)
TINY = Sizes(hidden=(32, 64), tp=(1, 2), tokens=(64,), fp8_tokens=(64,), attn_seq=(16, 32), attn_heads=(2,),
             attn_head_dim=(8, 16), attn_tokens=64, norm_tokens=64, norm_hidden=(32,), ce_tokens=64, ce_vocab=(256,),
             adam_tensors=4, adam_numel_per_tensor=1024, launch_count=50, copy_bytes=2**20)
ATTENTION_KERNELS = ("flash", "efficient", "cudnn")


def gemm_shapes(sizes: Sizes, tokens: tuple[int, ...], *, wgrad: bool = True) -> list[dict[str, Any]]:
    """Distinct (M, K, N) of the grid, each with the uses it stands for; shuffled (fixed seed) so that a table cut
    short by its deadline still covers the whole grid evenly."""
    shapes: dict[tuple[int, int, int], list[str]] = {}
    for h in sizes.hidden:
        for tp in sizes.tp:
            for kind, (k_mult, n_mult, split) in GEMM_KINDS.items():
                k, n = k_mult * h // (tp if split == "k" else 1), n_mult * h // (tp if split == "n" else 1)
                for t in tokens:
                    use = f"{kind} h={h} tp={tp} T={t}"
                    shapes.setdefault((t, k, n), []).append(use + " fwd")
                    if wgrad:
                        shapes.setdefault((k, t, n), []).append(use + " wgrad")
    rows = [{"m": m, "k": k, "n": n, "uses": uses} for (m, k, n), uses in shapes.items()]
    random.Random(0).shuffle(rows)
    return rows


def _gemm_row(row: dict[str, Any], device: torch.device, dtype: torch.dtype, rowwise: bool = False) -> dict[str, Any]:
    m, k, n = row["m"], row["k"], row["n"]
    sets = rotation_count((m * k + k * n) * dtype.itemsize, device, ROTATE_BUDGET_BYTES)
    if dtype == torch.bfloat16:
        pairs = [(randn((m, k), device, dtype), randn((k, n), device, dtype)) for _ in range(sets)]
        fns = [lambda a=a, b=b: torch.mm(a, b) for a, b in pairs]
    else:
        # tensorwise: one fp32 scale per operand; rowwise (torchao's rowwise recipe): one per row of A, per column of B
        scale_a, scale_b = ((torch.ones((m, 1), device=device), torch.ones((1, n), device=device)) if rowwise
                            else (torch.ones((), device=device),) * 2)
        # _scaled_mm wants the second operand column-major: the transpose of a contiguous (n, k)
        pairs = [(randn((m, k), device, dtype), randn((n, k), device, dtype).t()) for _ in range(sets)]
        fns = [lambda a=a, b=b: torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
               for a, b in pairs]
    s = median_s(fns, device)
    return {**row, "dtype": str(dtype).removeprefix("torch."), **({"scaling": "rowwise"} if rowwise else {}),
            "seconds": s, "flops": 2.0 * m * k * n, "flops_per_s": 2.0 * m * k * n / s if s > 0 else None}


def gemm_table(device: torch.device, sizes: Sizes, deadline: Deadline, *, fp8: bool,
               rowwise: bool = False) -> dict[str, Any]:
    """bf16 GEMMs over the full grid; with fp8, e4m3 `_scaled_mm` over the fp8 tokens (forward shapes), tensorwise
    scales or, rowwise, one per row."""
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    shapes = gemm_shapes(sizes, sizes.fp8_tokens, wgrad=False) if fp8 else gemm_shapes(sizes, sizes.tokens)
    return _rows_until(shapes, deadline, lambda r: _gemm_row(r, device, dtype, rowwise and fp8))


def _rows_until(items: list[dict[str, Any]], deadline: Deadline, measure) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    for item in items:
        if deadline.passed():
            return {"rows": rows, "truncated": True, "planned": len(items)}
        try:
            rows.append(measure(item))
        except Exception as e:  # noqa: BLE001 - one shape/kernel failing is a row, the table goes on
            rows.append({**item, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    return {"rows": rows, "truncated": False, "planned": len(items)}


def attention_flops(batch: int, seq: int, heads: int, head_dim: int, causal: bool) -> tuple[float, float]:
    """(forward, backward) FLOPs of one SDPA call (FlashAttention-2 paper's count)."""
    fwd = 4.0 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    return fwd, 2.5 * fwd


def _sdpa_backend(kernel: str):
    from torch.nn.attention import SDPBackend

    return {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[kernel]


def _attention_row(item: dict[str, Any], device: torch.device) -> dict[str, Any]:
    from torch.nn.attention import sdpa_kernel

    b, s, a, d, causal = item["batch"], item["seq"], item["heads"], item["head_dim"], item["causal"]
    q, k, v = (randn((b, a, s, d), device, torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = randn((b, a, s, d), device, torch.bfloat16)
    def fwd() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def both() -> None:
        q.grad = k.grad = v.grad = None  # a fresh gradient each call, as in training (no accumulation add)
        fwd().backward(grad)

    with sdpa_kernel([_sdpa_backend(item["kernel"])]):
        fwd_s = median_s([fwd], device, repeats=5)
        both_s = median_s([both], device, repeats=5)
    f_flops, b_flops = attention_flops(b, s, a, d, causal)
    bwd_s = max(both_s - fwd_s, 1e-12)
    return {**item, "dtype": "bfloat16", "fwd_s": fwd_s, "bwd_s": bwd_s, "fwd_flops_per_s": f_flops / fwd_s,
            "bwd_flops_per_s": b_flops / bwd_s, "fwd_flops": f_flops, "bwd_flops": b_flops}


def attention_table(device: torch.device, sizes: Sizes, deadline: Deadline) -> dict[str, Any]:
    items = [{"kernel": kern, "batch": max(1, sizes.attn_tokens // s), "seq": s, "heads": a, "head_dim": d,
              "causal": c}
             for s in sizes.attn_seq for a in sizes.attn_heads for d in sizes.attn_head_dim for c in (True, False)
             for kern in ATTENTION_KERNELS]
    random.Random(0).shuffle(items)
    return _rows_until(items, deadline, lambda it: _attention_row(it, device))


def _elementwise_cases(sizes: Sizes) -> list[dict[str, Any]]:
    cases = []
    for h in sizes.norm_hidden:
        t = sizes.norm_tokens
        act = t * h * 2  # one bf16 activation tensor
        cases += [{"op": "copy", "tokens": t, "hidden": h, "bytes": 2 * act},
                  {"op": "rmsnorm_fwd", "tokens": t, "hidden": h, "bytes": 2 * act + 2 * h},
                  {"op": "layernorm_fwd", "tokens": t, "hidden": h, "bytes": 2 * act + 4 * h},
                  {"op": "swiglu_fwd", "tokens": t, "hidden": 4 * h, "bytes": 3 * 4 * act},
                  {"op": "gelu_fwd", "tokens": t, "hidden": 4 * h, "bytes": 2 * 4 * act}]
    for vocab in sizes.ce_vocab:
        logits = sizes.ce_tokens * vocab
        # forward: read bf16 logits, write the fp32 upcast, read it; backward: write fp32 grad, cast to bf16
        cases.append({"op": "cross_entropy_fwd_bwd", "tokens": sizes.ce_tokens, "vocab": vocab,
                      "bytes": logits * (2 + 4 + 4 + 4 + 4 + 2)})
    return cases


def _elementwise_fn(case: dict[str, Any], device: torch.device):
    bf16 = torch.bfloat16
    op = case["op"]
    if op == "cross_entropy_fwd_bwd":
        logits = randn((case["tokens"], case["vocab"]), device, bf16, requires_grad=True)
        target = torch.randint(0, case["vocab"], (case["tokens"],), device=device)

        def step() -> None:
            logits.grad = None
            F.cross_entropy(logits.float(), target).backward()

        return step
    t, h = case["tokens"], case["hidden"]
    x = randn((t, h), device, bf16)
    if op == "copy":
        y = torch.empty_like(x)
        return lambda: y.copy_(x)
    if op == "rmsnorm_fwd":
        w = randn((h,), device, bf16)
        return lambda: F.rms_norm(x, (h,), w, 1e-5)
    if op == "layernorm_fwd":
        w, b = randn((h,), device, bf16), randn((h,), device, bf16)
        return lambda: F.layer_norm(x, (h,), w, b, 1e-5)
    if op == "swiglu_fwd":
        up = randn((t, h), device, bf16)
        return lambda: F.silu(x) * up
    if op == "gelu_fwd":
        return lambda: F.gelu(x)
    raise ValueError(f"unknown element-wise op {op!r}")


def elementwise_table(device: torch.device, sizes: Sizes, deadline: Deadline) -> dict[str, Any]:
    def measure(case: dict[str, Any]) -> dict[str, Any]:
        s = median_s([_elementwise_fn(case, device)], device)
        return {**case, "dtype": "bfloat16", "seconds": s, "bytes_per_s": case["bytes"] / s if s > 0 else None}

    return _rows_until(_elementwise_cases(sizes), deadline, measure)


def optimizer_table(device: torch.device, sizes: Sizes, deadline: Deadline) -> dict[str, Any]:
    """AdamW steps over `adam_tensors` fp32 tensors; bytes = 16 read (param, grad, m, v) + 12 written per element."""
    n = sizes.adam_tensors * sizes.adam_numel_per_tensor

    def measure(item: dict[str, Any]) -> dict[str, Any]:
        params = [randn((sizes.adam_numel_per_tensor,), device, torch.float32, requires_grad=True)
                  for _ in range(sizes.adam_tensors)]
        for p in params:
            p.grad = randn(p.shape, device, torch.float32)
        opt = torch.optim.AdamW(params, lr=1e-4, **{item["impl"]: True})
        s = median_s([opt.step], device, warmup=2, repeats=5)
        return {**item, "params": n, "tensors": sizes.adam_tensors, "seconds": s, "params_per_s": n / s,
                "bytes_per_s": 28.0 * n / s}

    return _rows_until([{"impl": "fused"}, {"impl": "foreach"}], deadline, measure)


def launch_table(device: torch.device, sizes: Sizes) -> dict[str, Any]:
    """Seconds per tiny kernel: device time of a saturated queue, and host time per launch call."""
    import time

    x = torch.ones(1, device=device)
    count = sizes.launch_count

    def burst() -> None:
        for _ in range(count):
            x.add_(1.0)

    device_s = median_s([burst], device, warmup=1, repeats=5) / count
    synchronize(device)
    t0 = time.perf_counter()
    burst()
    host_s = (time.perf_counter() - t0) / count
    synchronize(device)
    return {"device_s_per_kernel": device_s, "host_s_per_launch": host_s, "kernels": count}


def host_copy_table(device: torch.device, sizes: Sizes) -> dict[str, Any]:
    """Pinned host<->device bandwidth (non_blocking copies, timed on the device); n/a off CUDA."""
    if device.type != "cuda":
        return {"rows": [], "note": "host<->device copies need an accelerator: nothing to measure on the CPU"}
    numel = sizes.copy_bytes // 4
    host = torch.randn(numel).pin_memory()
    dev = torch.empty(numel, device=device)
    rows = []
    for direction, fn in (("h2d", lambda: dev.copy_(host, non_blocking=True)),
                          ("d2h", lambda: host.copy_(dev, non_blocking=True))):
        s = median_s([fn], device)
        rows.append({"direction": direction, "pinned": True, "bytes": sizes.copy_bytes, "seconds": s,
                     "bytes_per_s": sizes.copy_bytes / s})
    return {"rows": rows}
