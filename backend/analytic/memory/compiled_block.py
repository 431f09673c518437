"""What a transformer block saves for backward when it runs under torch.compile (torchtitan's apply_compile: one
torch.compile per block), for the families measured (pure Python).

Inductor's partitioner (min-cut rematerialisation) keeps what backward reads and recomputes cheap element-wise work
from it. Measured with torch 2.13's Inductor on the CPU on this engine's blocks (saved_tensors_hooks on the compiled
graph, parameters left out: tests/unit/test_compiled_block.py); the partition is the same FX graph on CUDA. Per token,
at the compute dtype c unless noted:
- the block input and both norms' outputs (the QKV and MLP inputs): 3 h; the second norm's input is recomputed;
  under autocast (fp32 weights, torch.autocast) the block input is the fp32 residual stream (4 B) and the norms'
  outputs their 16-bit casts;
- q (after RoPE), k and v as the attention kernel gets them (GQA's repeated copies), and its output: 2 q + 2 v;
  the o projection's input, a copy of that output with the heads merged: v; the fp32 log-sum-exp per head;
- with q / k RMSNorm (Qwen3, Gemma 3): the q and k projections' outputs (q + kv heads x head width) and an fp32 rstd
  per head;
- the norms' statistics in fp32 (RMSNorm's rstd, LayerNorm's mean and rstd);
- the MLP: GELU its fc_in output and the activation's output (2 f); SwiGLU / GeGLU / gpt-oss's clamped SwiGLU the
  gate and up outputs and their product (3 f): the activation itself is recomputed;
- no RoPE cos / sin tables (recomputed).
Against the eager block (activations.layer_activation_bytes on CUDA) that drops the activation's output of a gated MLP
(and the clamped SwiGLU's four intermediates) and the RoPE tables, and keeps the same bytes for GELU blocks.
Under autocast (stack shardlab's engine: fp32 weights, torch.autocast) it keeps one fp32 tensor, the block input,
where the eager block also keeps both norms' fp32 outputs and the second norm's fp32 input; the weights' 16-bit casts
are saved as in eager (rank_activations.autocast_casts counts them, not this term). Measured under
torch.autocast("cpu", bfloat16); CUDA's autocast op lists differ in places, so on CUDA ranks this is the CPU
partition's bytes.
Under this engine's selective recompute (the attention core checkpointed inside the block) it keeps the same less
the attention output and its log-sum-exp (the o projection's input stays); the checkpoint also saves the CPU
generator's state (torch.get_rng_state(), 5,056 B of host memory per block), not device memory, left out.
Not measured, so `None` (the eager terms apply): tensor parallelism (DTensor under compile), MoE, MLA, sandwich norms,
windowed attention, math attention, and torchao's float8 casts.
"""

from __future__ import annotations

from backend.analytic.memory.activations import LSE_BYTES, STAT_BYTES, LayerShape
from backend.analytic.params import is_gated

MEASURED_MLPS = frozenset({"gelu", "swiglu", "geglu", "swiglu_clamped"})


def compiled_block_bytes(shape: LayerShape, selective: bool = False) -> float | None:
    """Bytes one compiled block keeps for backward (no recompute; selective: its attention core checkpointed), or None
    outside the measured families."""
    if (shape.tp > 1 or shape.n_experts or shape.kv_lora or shape.sandwich_norm or shape.windowed or not shape.flash
            or str(shape.mlp) not in MEASURED_MLPS):
        return None
    sb, h, c, a = shape.seq_len * shape.micro_batch, shape.d_model, shape.dtype_bytes, shape.n_heads
    q = shape.q_width or h
    v = shape.v_width or q
    kv = (shape.kv_heads or a) * (q // a)
    elems = 2 * h + 2 * q + 2 * v + v + (3 if is_gated(shape.mlp) else 2) * shape.ffn
    block_input = h * (4 if shape.autocast else c)
    fp32_rows = LSE_BYTES * a
    if selective:  # the checkpointed core's output and LSE are recomputed in backward
        elems, fp32_rows = elems - v, 0
    if shape.qk_norm:
        elems += q + kv
        fp32_rows += 4 * (a + (shape.kv_heads or a))
    stats = 2 * (1 if str(shape.norm) == "rmsnorm" else 2) * STAT_BYTES
    return sb * (elems * c + block_input + fp32_rows + stats)
