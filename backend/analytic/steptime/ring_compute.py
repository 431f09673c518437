"""What a context-parallel ring computes on one rank per attention call, apart from its transfers (cp_ring.py):
the fused-attention calls at their own shapes and the memory-bound merging of their partial results (pure Python;
scalars or arrays of layouts). Hand-written: neither torch nor Transformer Engine publishes a cost model of its ring.

Both rings cut the rank's queries against the cp K/V blocks the same way (head-tail chunks: the local causal block,
then cp - 1 half squares), and both merge each block's partial output by its logsumexp:
- torch's `_templated_ring_attention` (stacks shardlab, torchtitan, deepspeed; torch 2.13
  torch/distributed/tensor/experimental/_context_parallel/_attention.py): `_SDPAMerger` keeps the output in fp32
  (convert_to_f32, the default): the first block cast up (6 B per output element), each later block cast up, then
  `out - sigmoid(block_lse - lse) * (out - block_out)` in 3 eager kernels (38 B), the result cast back (6 B);
  backward accumulates dQ and the (head-repeated) dK, dV in fp32 per block (10 B each: read 4 + 2, write 4) and casts
  them back at the end (6 B). Around the merging, the ring's own copies (the same statements in pytorch 0123248a
  torch/distributed/tensor/experimental/_attention.py, in 09b101c5 .../_context_parallel/_attention.py, and in the
  older copy with _RotateMethod.PRE_ALL_GATHER of the era of torchtitan's Dec 2024 benchmark, torch 1963fc8, whose
  own file the source index lacks):
  `torch.cat([key.flatten(), value.flatten()])` before every send, i < cp - 1, forward and backward, whatever the
  rotater (4 B per K/V element); backward `torch.zeros_like` of the three fp32 accumulators (4 B), the fp32 dK/dV
  `torch.cat` before each of the cp sends (8 B), and on the last rank (i <= rank, load balancing on) dK/dV added
  through `_partial_update(add=True)`: the half's in-place add then a `torch.cat` of both halves (5 + 8 B per
  element in place of 10).
- Transformer Engine's `AttnFuncWithCPAndKVP2P` (stack megatron; traffic.TE_RING_SOURCE), non-fp8: the output in the
  compute dtype, `flash_attn_fwd_out_correction_init` (read 2, write 2) then one fused `out.add_(out_per_step *
  exp(..))` per later block (read 4, write 2); backward `dq.copy_` / `dq.add_` and `dk.add_`, `dv.add_` at the GQA
  width per block (4 B to copy, 6 B to add).
Every block is counted whole (the last cp rank's; head-tail chunks hand the first ranks half blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend.analytic.layout import Layout
from backend.analytic.params import head_dim, v_head_dim
from backend.analytic.scalar_or_array import maximum, where
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.steptime.ops import attention_time

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec

TORCH_MERGE_STEP_BYTES = 38
"""Bytes per output element of one `_SDPAMerger._merge_one` after the cast up: out - block_out (read 4 + 4, write 4),
sigmoid(..) * (..) (read 4, write 4), out - (..) (read 4 + 4, write 4), and the block's cast (read 2, write 4)."""
CAST_UP, CAST_DOWN, FP32_ADD = 6, 6, 10
TE_FIRST, TE_ADD, TE_COPY, TE_GRAD_ADD = 4, 6, 4, 6
TORCH_KV_CAT, TORCH_DKV_CAT, TORCH_ZEROS = 4, 8, 4
"""Bytes per element of torch's ring copies (module docstring): bf16 K/V cat (read 2, write 2), fp32 dK/dV cat (read
4, write 4), an fp32 accumulator's zeros (write 4)."""
TORCH_PARTIAL_ADD_EXTRA = 3
"""`_partial_update(add=True)`'s bytes per dK/dV element over a plain fp32 add: 10 / 2 on the half + 8 (cat) - 10."""


@dataclass(frozen=True)
class RingMerge:
    """Memory-bound bytes and kernels of one attention call's merging on one rank (scalars or arrays)."""
    fwd_bytes: Num
    fwd_kernels: Num
    bwd_bytes: Num
    bwd_kernels: Num


def ring_blocks_time(hw: Hardware, layout: Layout, attention: str, b: Num, heads: Num, rows: Num,
                     head_dim_: float) -> tuple[Num, Num]:
    """(forward, backward) seconds of the fused-attention calls a ring makes on the busiest cp rank, at their own
    shapes: the local causal block (its `rows` queries and keys, rows = s / cp), then cp - 1 blocks without a mask.
    Head-tail chunks make each of those half a square (queries against half the keys, or half the queries against
    all); contiguous chunks leave the last rank cp - 1 whole squares (compute.cp_imbalance's (2cp - 1) / cp of the
    work). cp = 1: the one causal call."""
    diag_f, diag_b = attention_time(hw, layout.precision, attention, b, heads, rows, head_dim_, causal=True)
    full_f, full_b = attention_time(hw, layout.precision, attention, b, heads, rows, head_dim_, causal=False)
    blocks = (layout.cp - 1) * where(layout.cp_load_balance, 0.5, 1.0)
    return diag_f + blocks * full_f, diag_b + blocks * full_b


def ring_merge(model: ModelSpec, layout: Layout) -> RingMerge:
    """The merging of one attention call's cp blocks on one rank (module docstring); nothing at cp = 1."""
    cp, rows, tp = layout.cp, layout.seq_local(model), layout.tp
    out = layout.micro_batch * rows * (model.n_heads // tp) * v_head_dim(model)
    later = maximum(cp - 1, 0)
    on = cp > 1
    if layout.te_ring:
        kv = 2 * layout.micro_batch * rows * maximum(model.kv_heads // tp, 1) * head_dim(model)
        fwd, fwd_k = TE_FIRST * out + later * TE_ADD * out, cp
        bwd = TE_COPY * (out + kv) + later * TE_GRAD_ADD * (out + kv)
        return RingMerge(where(on, fwd, 0.0), where(on, fwd_k, 0), where(on, bwd, 0.0), where(on, 3 * cp, 0))
    kv = 2 * layout.micro_batch * rows * (model.n_heads // tp) * head_dim(model)
    fwd = (CAST_UP + CAST_DOWN) * out + later * TORCH_MERGE_STEP_BYTES * out + later * TORCH_KV_CAT * kv
    bwd = cp * FP32_ADD * (out + kv) + CAST_DOWN * (out + kv) + _torch_ring_copies_bwd(layout, kv, out)
    partial = where(layout.cp_load_balance, 2 * later, 0)
    return RingMerge(where(on, fwd, 0.0), where(on, 2 + 5 * later, 0), where(on, bwd, 0.0),
                     where(on, 3 * cp + 3 + 3 + later + cp + partial, 0))


def _torch_ring_copies_bwd(layout: Layout, kv: Num, out: Num) -> Num:
    """Bytes of torch's backward ring copies on the last cp rank (module docstring): the fp32 accumulators' zeros,
    the K/V cat before each of the cp - 1 sends, the fp32 dK/dV cat before each of the cp sends, and the
    `_partial_update` surplus of the cp - 1 later dK/dV adds under load balancing."""
    later = maximum(layout.cp - 1, 0)
    partial = where(layout.cp_load_balance, later * TORCH_PARTIAL_ADD_EXTRA * kv, 0.0)
    return TORCH_ZEROS * (out + kv) + later * TORCH_KV_CAT * kv + layout.cp * TORCH_DKV_CAT * kv + partial
