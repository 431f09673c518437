"""The seed documents' numeric claims, recomputed from the textbook formulas (pure Python).

Seeds live in /work/shared/seeds/*.txt. `seed_estimate_gpu_memory` reproduces seed 000's function AS
WRITTEN; `seed_claims()` checks every numeric claim against formula_value computed by the functions in
this package (never typed in). GB here is decimal (1e9), as the seeds and the ZeRO paper use.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from backend.analytic.textbook.kv_cache import kv_cache_bytes
from backend.analytic.textbook.pipeline import pipeline_utilisation
from backend.analytic.textbook.zero import precision_bytes, zero_memory_reduction, zero_model_state_bytes
from backend.analytic.units import GB

SEED_000 = "seed 000 (Model Sharding)"
SEED_003 = "seed 003 (Ch. 11 Data Parallelism & Sharding)"
SEED_004 = "seed 004 (L18 Model Parallelism)"
A100_GB = 80.0


@dataclass(frozen=True)
class Claim:
    id: str
    source: str
    text: str
    claimed_value: float
    unit: str
    formula_value: float
    formula: str
    holds: bool
    tolerance: float
    explanation: str
    comparison: str = "approx"  # approx: |f - c| <= tol·|c|; at_most: f <= c; at_least: f >= c

    def as_dict(self) -> dict:
        return asdict(self)


def _claim(id, source, text, claimed, unit, value, formula, explanation, tol=0.05, comparison="approx") -> Claim:
    if comparison == "approx":
        holds = abs(value - claimed) <= tol * abs(claimed)
    elif comparison == "at_most":
        holds = value <= claimed
    elif comparison == "at_least":
        holds = value >= claimed
    else:
        raise ValueError(f"unknown comparison {comparison!r}")
    return Claim(id, source, text, float(claimed), unit, float(value), formula, bool(holds), tol, explanation,
                 comparison)


def seed_estimate_gpu_memory(model_params_B: float, n_gpus: int, precision_bytes: int = 2,
                             context_length: int = 4096, batch_size: int = 1, n_layers: int = 80,
                             hidden_dim: int = 8192, n_kv_heads: int = 8) -> dict:
    """Seed 000's `estimate_gpu_memory`, verbatim in effect (weights/P + unsplit KV cache)."""
    model_mem = model_params_B * 1e9 * precision_bytes / n_gpus
    # Seed quirk: assumes n_heads = 8·n_kv_heads. The real head_dim is hidden/n_heads (8192/64 = 128 for
    # Llama-2-70B, which this happens to match); and the KV cache is not split by P although TP splits heads.
    head_dim = hidden_dim // (n_kv_heads * 8)
    kv_per_layer = 2 * batch_size * context_length * n_kv_heads * head_dim * precision_bytes
    kv_total = kv_per_layer * n_layers
    total = model_mem + kv_total
    return {"model_GB": model_mem / 1e9, "kv_GB": kv_total / 1e9, "total_GB": total / 1e9}


def _weights_gb(n_params: float, precision: str) -> float:
    return n_params * precision_bytes(precision, "adamw")[0] / GB


def _seed000_claims() -> list[Claim]:
    out = []
    for name, billions, claimed in (("7b", 7, 14), ("13b", 13, 26), ("70b", 70, 140), ("405b", 405, 810)):
        out.append(_claim(f"s000-fp16-size-{name}", SEED_000, f"LLaMA-{name.upper()} FP16 size {claimed} GB",
                          claimed, "GB", _weights_gb(billions * 1e9, "bf16-mixed"), "Ψ · 2 bytes",
                          "Weights only, nominal parameter count (LLaMA-7B really has 6.74B: 13.5 GB)."))
    for name, billions, claimed in (("70b", 70, 2), ("405b", 405, 10)):
        gpus = math.ceil(_weights_gb(billions * 1e9, "bf16-mixed") / A100_GB)
        out.append(_claim(f"s000-gpus-{name}", SEED_000, f"LLaMA-{name.upper()}: {claimed}+ GPUs (A100 80GB)",
                          claimed, "GPUs", gpus, "ceil(2Ψ / 80 GB)",
                          "Weights only; KV cache, activations and runtime overhead need more.",
                          comparison="at_least"))
    seed = seed_estimate_gpu_memory(70, 8)
    kv = kv_cache_bytes(batch=1, context=4096, n_layers=80, n_kv_heads=8, head_dim=8192 // 64, dtype_bytes=2)
    out.append(_claim("s000-kv-70b", SEED_000, "estimate_gpu_memory(70, P) KV cache (4096 ctx, batch 1, fp16)",
                      seed["kv_GB"], "GB", kv / GB, "2·b·s·L·n_kv·d_head·bytes (vLLM, Kwon 2023 Sec 3)",
                      "The seed's head_dim = hidden/(8·n_kv) equals the true 8192/64 = 128 for Llama-2-70B.", tol=1e-9))
    kv_tp = kv_cache_bytes(batch=1, context=4096, n_layers=80, n_kv_heads=8, head_dim=128, dtype_bytes=2, tp=8)
    out.append(_claim("s000-kv-not-split", SEED_000,
                      "KV cache and activations are not divided by P in tensor parallelism (70B, P=8)",
                      seed["kv_GB"], "GB per GPU", kv_tp / GB, "kv_cache_bytes(..., tp=8)",
                      "Megatron-style TP splits attention heads, so each rank caches n_kv/t KV heads "
                      "(replicated only when n_kv < t); TP also splits most layer activations "
                      "(Korthikanti 2022 Table 2: 24/t of 34).", tol=0.05))
    return out


def _seed003_claims() -> list[Claim]:
    fp32_175 = _weights_gb(175e9, "fp32")
    out = [_claim("s003-gpt3-fp32", SEED_003, "A 175B model requires 700GB just to store the weights in float32",
                  700, "GB", fp32_175, "Ψ · 4 bytes", "Holds.")]
    pb, gb, k = precision_bytes("bf16-mixed", "adamw")
    per_param = zero_model_state_bytes(1.0, n=1, stage=0, k=k, param_bytes=pb, grad_bytes=gb)["total_bytes"]
    out.append(_claim("s003-20x", SEED_003, "Mixed precision: Total memory ≈ 20× model size", 20,
                      "bytes per parameter", per_param, "(2 + 2 + K)Ψ with K = 12 (ZeRO Sec 3.1)",
                      "ZeRO's mixed-precision Adam model states are 16 bytes/param: 8x the fp16 weights, 4x the "
                      "fp32 weights, 16x the parameter count. 20 is only reached with extra buffers or activations.",
                      tol=0.1))
    n_big = 1024
    for stage, claimed in ((1, 4), (2, 8)):
        red = zero_memory_reduction(n=n_big, stage=stage, k=k, param_bytes=pb, grad_bytes=gb)
        out.append(_claim(f"s003-zero{stage}-savings", SEED_003, f"ZeRO stage {stage}: Memory Savings: {claimed}x",
                          claimed, "x", red, f"(4+K)Ψ / stage-{stage} bytes, K=12, N={n_big}",
                          f"ZeRO Figure 1: the {claimed}x is the large-N limit; at N=8 it is "
                          f"{zero_memory_reduction(n=8, stage=stage):.2f}x.", tol=0.05))
    red3 = zero_memory_reduction(n=64, stage=3, k=k, param_bytes=pb, grad_bytes=gb)
    out.append(_claim("s003-zero3-linear", SEED_003, "ZeRO stage 3: Memory Savings: Linear with N (N=64)", 64,
                      "x", red3, "(4+K)Ψ / ((4+K)Ψ/N)", "Exactly N for model states; activations are not sharded.",
                      tol=1e-9))
    states = zero_model_state_bytes(70e9, n=8, stage=0, k=k, param_bytes=pb, grad_bytes=gb)["total_bytes"] / 8
    out.append(_claim("s003-70b-one-node", SEED_003, "Llama 70B fits on 1 node (TP=8, DP=4), 80 GB A100s",
                      A100_GB, "GB per GPU", states / GB, "(2+2+12)·70e9 / 8 (TP=8 splits model states 8 ways)",
                      "Mixed-precision Adam model states alone are 140 GB per GPU with TP=8 and plain DP; it "
                      "fits only with ZeRO/FSDP over the DP=4 replicas too (1120/32 = 35 GB).",
                      comparison="at_most"))
    return out


def _seed004_claims() -> list[Claim]:
    psi = 7e9
    pb, gb, k = precision_bytes("fp32", "adamw")
    s0 = zero_model_state_bytes(psi, n=1, stage=0, k=k, param_bytes=pb, grad_bytes=gb)
    act_gb = 10.0  # the seed's activation row, taken as given (no batch or sequence length stated)
    out = [_claim("s004-70b-fp32", SEED_004, "A 70B parameter model requires 280 GB in FP32", 280, "GB",
                  _weights_gb(70e9, "fp32"), "Ψ · 4 bytes", "Holds.")]
    for key, claimed, label in (("params_bytes", 28, "Model weights"), ("grads_bytes", 28, "Gradients"),
                                ("optimizer_bytes", 56, "Optimizer states")):
        out.append(_claim(f"s004-7b-{key.split('_')[0]}", SEED_004, f"7B: {label} {claimed} GB", claimed, "GB",
                          s0[key] / GB, "fp32 AdamW: 4Ψ, 4Ψ, 8Ψ", "Holds for fp32 AdamW (m and v)."))
    out.append(_claim("s004-7b-total", SEED_004, "7B: Total 122 GB (with 10 GB activations)", 122, "GB",
                      s0["total_bytes"] / GB + act_gb, "16Ψ + the seed's 10 GB activations",
                      "The 10 GB activation row gives no batch or sequence length, so only the sum is checked."))
    s1 = zero_model_state_bytes(psi, n=8, stage=1, k=k, param_bytes=pb, grad_bytes=gb)
    out.append(_claim("s004-zero1-opt", SEED_004, "ZeRO-1: 56 GB / 8 GPUs = 7 GB per GPU (optimizer states)", 7,
                      "GB", s1["optimizer_bytes"] / GB, "KΨ/N",
                      f"The optimizer shard holds; the rank still keeps full weights and grads: "
                      f"{s1['total_bytes'] / GB:.0f} GB of model states per GPU."))
    s2 = zero_model_state_bytes(psi, n=8, stage=2, k=k, param_bytes=pb, grad_bytes=gb)
    out.append(_claim("s004-zero2-shard", SEED_004, "ZeRO-2: (56 + 28) GB / 8 = 10.5 GB per GPU", 10.5, "GB",
                      (s2["optimizer_bytes"] + s2["grads_bytes"]) / GB, "(4+K)Ψ/N",
                      f"Holds for the sharded part; plus full fp32 weights: {s2['total_bytes'] / GB:.1f} GB."))
    s3 = zero_model_state_bytes(psi, n=8, stage=3, k=k, param_bytes=pb, grad_bytes=gb)
    out.append(_claim("s004-zero3-total", SEED_004, "ZeRO-3: Total 122 GB / 8 GPUs = 15 GB per GPU", 15, "GB",
                      s3["total_bytes"] / GB + act_gb, "(4+4+8)Ψ/N + activations (not sharded by ZeRO)",
                      "ZeRO-3 shards model states (112/8 = 14 GB) but each rank keeps the activations of its own "
                      "microbatch (10 GB): 24 GB. 15 GB needs the activations divided by 8 too.", tol=0.1))
    out.append(_claim("s004-naive-pp", SEED_004, "Naive pipeline, 4 GPUs: Utilization 25%", 0.25, "fraction",
                      pipeline_utilisation("gpipe", p=4, m=1), "m/(m+p-1), m=1, p=4 (GPipe Sec 2.3)", "Holds."))
    out.append(_claim("s004-gpipe-75", SEED_004, "GPipe, 4 GPUs, 4 micro-batches: Utilization ~75%", 0.75,
                      "fraction", pipeline_utilisation("gpipe", p=4, m=4), "m/(m+p-1) = 4/7 (GPipe Sec 2.3)",
                      "The seed's own timeline shows each GPU busy 4 of 7 slots: 57%. 75% needs m = 9 "
                      "(m/(m+3) ≥ 0.75).", tol=0.1))
    return out


def seed_claims() -> list[Claim]:
    """Every numeric claim of the seeds, with the formula's value and whether the claim holds."""
    return _seed000_claims() + _seed003_claims() + _seed004_claims()
