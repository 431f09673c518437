"""Published end-to-end training throughput used as evidence for the step-time model (pure Python).

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
(SC'21), Table 1: GPT, V = 51,200, s = 2,048, mixed precision, full activation recomputation, Selene
(DGX A100 80GB, 8 GPUs per node, 8x HDR InfiniBand). Achieved TFLOP/s per GPU counts Eq. 3's FLOPs.
Table 1 gives no microbatch size or schedule: we assume b = 1 and the non-interleaved 1F1B schedule for
every row (Sec 5.1 states the 1F1B schedule's use where not noted otherwise).
"""

from __future__ import annotations

from typing import Any

from backend.analytic.textbook.flops import narayanan_flops_per_iteration

# (params billions, heads, hidden, layers, t, p, GPUs, batch, published TFLOP/s per GPU)
PTDP_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
VOCAB, SEQ = 51200, 2048


def ptdp_spec_dict(row: tuple) -> dict[str, Any]:
    """Experiment spec of one Table 1 row (b = 1, 1F1B, bf16 mixed, full recompute, ddp on dp)."""
    _, heads, h, layers, t, p, gpus, batch, _ = row
    return {"name": f"PTD-P Table 1 {row[0]}B", "model": {"vocab_size": VOCAB, "d_model": h, "n_layers": layers,
                                                          "n_heads": heads, "seq_len": SEQ},
            "train": {"global_batch": batch, "micro_batch": 1, "precision": "bf16-mixed", "recompute": "full"},
            "parallel": {"strategy": "ddp", "world_size": gpus, "tp": t, "pp": p, "pp_schedule": "1f1b"}}


def ptdp_predicted_tflops(row: tuple, step_s: float) -> float:
    """Eq. 3 FLOPs per iteration / (step time x GPUs): the paper's own accounting."""
    _, _, h, layers, _, _, gpus, batch, _ = row
    return narayanan_flops_per_iteration(B=batch, s=SEQ, l=layers, h=h, V=VOCAB) / (step_s * gpus) / 1e12
