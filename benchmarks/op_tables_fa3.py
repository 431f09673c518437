"""The "fa3-paper-h100" attention table (kernel "flash3") for benchmarks/op_tables_build.py: FlashAttention-3 on an
H100 80GB SXM5 in BF16, from the FlashAttention-3 paper (Shah et al. 2024, arXiv 2407.08608 v2), as fractions of the
dense bf16 peak (989.4 TFLOP/s). The paper counts FLOPs as FlashAttention-2 does (forward 4 * seq^2 * head_dim *
heads, halved when causal; backward 2.5x), which is how steptime/ops.attention_time times a kernel.

- Forward (causal and not, head dim 64 / 128 / 256, seq 512 .. 16k; batch x seq = 16k tokens, hidden 2048): the
  figure Dao-AILab/flash-attention @0251105a2fb19d2957484b7f023cd8c115286ced ships as assets/flash3_fp16_fwd.png,
  read bar by bar (the research notes, stacks.md Sec 6.1). The head-dim-256 bar at seq 1k, whose label the legend
  hides, is left out.
- Backward: the paper's backward figure is read only for the non-causal panels (head dim 128, seq 512 .. 16k; head
  dim 64, seq 512 .. 2k; third-party transcriptions, stacks.md Sec 6.1). Every row's backward takes its forward times
  the measured backward / forward ratio at the same sequence length (head dim 64's own up to 2k, else head dim
  128's); causal rows take the non-causal ratio, as no causal backward panel was read.
"""

from __future__ import annotations

PEAK_TFLOPS = 989.4
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
FORWARD = {  # (head_dim, causal): TFLOP/s by SEQS; None = not read
    (64, False): (333, 392, 460, 476, 496, 497),
    (128, False): (467, 565, 625, 638, 646, 648),
    (256, False): (482, None, 707, 736, 746, 756),
    (64, True): (197, 265, 371, 420, 460, 473),
    (128, True): (292, 423, 521, 579, 602, 616),
    (256, True): (286, 427, 537, 612, 628, 642),
}
BACKWARD_NONCAUSAL = {64: (272, 363, 422, None, None, None), 128: (316, 424, 501, 542, 559, 561)}
SOURCE = ("published: Shah et al. 2024, 'FlashAttention-3: Fast and Accurate Attention with Asynchrony and "
          "Low-precision' (arXiv 2407.08608 v2), H100 80GB SXM5, BF16: forward from the paper's figure "
          "(Dao-AILab/flash-attention 0251105a assets/flash3_fp16_fwd.png), backward from its non-causal backward "
          "panels (head dim 128; head dim 64 to 2k) as a backward / forward ratio per sequence length applied to every "
          "row (causal rows included); TFLOP/s / 989.4 (benchmarks/op_tables_fa3.py)")


def _ratio(head_dim: int, i: int) -> float:
    """Backward over forward TFLOP/s at SEQS[i], non-causal: head dim 64's where read, else head dim 128's."""
    own = BACKWARD_NONCAUSAL.get(head_dim, (None,) * len(SEQS))[i]
    d = head_dim if own is not None else 128
    return BACKWARD_NONCAUSAL[d][i] / FORWARD[(d, False)][i]


def fa3_table() -> dict:
    """{"rows": [{kernel, seq, head_dim, causal, fwd, bwd}], "source"} (module docstring)."""
    rows = []
    for (head_dim, causal), tflops in FORWARD.items():
        for i, (seq, fwd) in enumerate(zip(SEQS, tflops, strict=False)):
            if fwd is None:
                continue
            rows.append({"kernel": "flash3", "seq": seq, "head_dim": head_dim, "causal": causal,
                         "fwd": round(fwd / PEAK_TFLOPS, 4), "bwd": round(fwd * _ratio(head_dim, i) / PEAK_TFLOPS, 4)})
    return {"rows": rows, "source": SOURCE}
