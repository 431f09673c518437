"""What an MoE block holds differently when its experts run as grouped GEMMs (ModelSpec.moe_grouped_gemm;
models/grouped_experts.GroupedLinear): the 16-bit weight copies it keeps out (`grouped_expert_elems`) and the
stacked weights it holds at its fullest op (`grouped_excess_bytes`).

GroupedLinear casts the local experts' weights and biases inside its own autograd Function, stacks them for one
grouped matmul and drops the stack; it saves the fp32 weights themselves and stacks them again in backward. So no
16-bit expert weight or bias lives in autocast's cache or among the saved tensors, where the per-expert loop's
F.linear keeps one per Linear. The grouped path runs only where `grouped_experts.grouped_reason` lets it: plain (not
tensor-parallel, not float8) experts whose in and out features fill whole 16-byte rows in the compute dtype.

The stack is what a grouped block holds beyond the per-expert loop: its forward stacks every local expert's weight of
one Linear as a (G, in, out) tensor in the compute dtype (under autocast next to the per-expert casts it stacks) for
the one grouped matmul. The down projection's stack, made with all of the block's saved tensors up to the down
projection's input alive (and, under autocast, the fp32 routed rows the 16-bit casts were made from), is the block's
fullest op (read off the engine op by op on the CPU; tests/unit/test_grouped_experts_peak.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from backend.analytic.layout import Layout, RecomputeMode
from backend.analytic.memory.moe_bytes import INDEX_BYTES, row_bytes
from backend.analytic.memory.parts import is_mixed
from backend.analytic.params import expert_ffn, is_gated, layer_is_moe
from backend.analytic.scalar_or_array import logical_and, logical_not, logical_or, maximum, where

if TYPE_CHECKING:
    from backend.analytic.memory.policy_blocks import Checkpointing
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec

ROW_STRIDE_BYTES = 16
"""grouped_mm's row stride (models/grouped_experts.STRIDE_BYTES)."""


def grouped_expert_elems(model: ModelSpec, layout: Layout) -> tuple[Num, Num]:
    """(weight, bias) elements of one MoE block's local experts that keep no 16-bit copy (module docstring); (0, 0)
    where the per-expert loop runs."""
    if not model.is_moe or not getattr(model, "moe_grouped_gemm", False):
        return 0.0, 0.0
    h, f, runs = model.d_model, expert_ffn(model), grouped_runs(model, layout)
    gated = is_gated(str(model.mlp))
    local = model.n_experts / layout.ep
    weights = local * (3 if gated else 2) * h * f
    biases = local * ((2 * f + h) if gated else (f + h)) if str(model.bias) == "all" else 0
    return where(runs, weights, 0), where(runs, biases, 0)



def grouped_runs(model: ModelSpec, layout: Layout) -> Num:
    """Whether the MoE blocks run their experts as grouped GEMMs (`grouped_experts.grouped_reason` is None)."""
    if not model.is_moe or not getattr(model, "moe_grouped_gemm", False):
        return False
    h, f, cb = model.d_model, expert_ffn(model), layout.compute_bytes
    plain = where(layout.ep > 1, layout.etp == 1, layout.tp == 1)
    rows_fit = logical_and((h * cb) % ROW_STRIDE_BYTES == 0, (f * cb) % ROW_STRIDE_BYTES == 0)
    return logical_and(logical_and(plain, rows_fit), layout.precision != "fp8")


def grouped_excess_bytes(model: ModelSpec, layout: Layout) -> Num:
    """What a grouped-GEMM MoE block of the dense dispatch (ep = 1, models/moe_sorted.dense_dispatch) holds above its
    saved tensors at the down projection's stack (module docstring), where grouped GEMMs run; 0 elsewhere. Then the
    down projection's stacked weight is alive (the per-expert casts it stacks too under autocast, at the stack; its
    (rows, h) output next to the stack, at the grouped matmul), and nothing after the matmul is saved yet: its output,
    the gathered routing weights and their int64 order, the weighted rows and index_add's int64 index."""
    if not model.is_moe or not getattr(model, "moe_grouped_gemm", False):
        return 0.0
    runs = logical_and(grouped_runs(model, layout), layout.ep == 1)
    h, f, cb = model.d_model, expert_ffn(model), layout.compute_bytes
    rb = where(layout.uses_autocast, row_bytes(cb, True), cb)
    rows = layout.micro_batch * layout.seq_local(model) * model.top_k
    stacked = model.n_experts * h * f * cb
    output = rows * h * cb
    # under autocast the gathered routed rows (fp32) are alive as run_grouped's argument, not saved: the gate and up
    # GEMMs save their 16-bit cast
    rows_in = where(layout.uses_autocast, rows * h * rb, 0)
    held = maximum(where(layout.uses_autocast, 2 * stacked, stacked), stacked + output) + rows_in
    saved_after = output + rows * (2 * INDEX_BYTES + rb + h * rb)
    return where(runs, maximum(0.0, held - saved_after), 0.0)


def inside_grouped_block(model: ModelSpec, layout: Layout, ck: Checkpointing, blocks: Num, held: Num) -> Num:
    """The moment inside the last block's forward where a grouped-GEMM MoE block holds its stacked expert weights
    (`grouped_excess_bytes`): the rank's saved bytes then (`blocks`; a pipeline rank's in-flight microbatches and
    stage buffers), `held` (autocast's cached casts, the previous microbatch's logits) and the excess; 0 unless the
    rank's last block is such a block and not checkpointed (a checkpointed one peaks at its re-run,
    `rerun_transient`). A pipeline rank's last block is taken to be MoE only where every block is."""
    if not getattr(model, "moe_grouped_gemm", False) or not layer_is_moe(model, model.n_layers - 1):
        return 0.0
    excess = grouped_excess_bytes(model, layout)
    last_plain = logical_or(ck.units == 0, ck.after > 0)
    known_last = logical_not(layout.pipelined) if is_mixed(model) else True
    return where(logical_and(last_plain, known_last), blocks + held + excess, 0.0)


def grouped_outweighs_head(model: ModelSpec, layout: Layout, head_beyond: Num) -> Num:
    """Without pipelining, the stack's moment (`inside_grouped_block`) is the activation peak rather than the loss: the
    excess and the previous microbatch's logits outweigh what the head and loss add after the blocks (`head_beyond`:
    activations.head_beyond_blocks_bytes), with the last block grouped MoE and not checkpointed. Ties keep the loss."""
    if not getattr(model, "moe_grouped_gemm", False) or not layer_is_moe(model, model.n_layers - 1):
        return False
    previous = previous_logits_bytes(model, layout)
    plain_last = logical_or(layout.recompute == RecomputeMode.NONE, layout.recompute == RecomputeMode.SELECTIVE)
    return logical_and(logical_and(plain_last, logical_not(layout.pipelined)),
                       grouped_excess_bytes(model, layout) + previous > head_beyond)


def previous_logits_bytes(model: ModelSpec, layout: Layout) -> Num:
    """What of the previous microbatch's logits is alive inside the next one's forward (a pure data-parallel loop
    without pipelining): measured at the grouped stack's moment (vocab 128 and 256, fp32 and bf16-mixed, ddp, zero1,
    zero2, zero3), the (mb, T, V) logits in the compute dtype, except under FSDP2 in fp32."""
    logits = layout.micro_batch * layout.seq_local(model) * model.vocab_size * layout.compute_bytes
    held = logical_and(layout.microbatches > 1, logical_not(layout.pipelined))
    return where(logical_and(held, logical_or(layout.compute_bytes != 4, logical_not(layout.fsdp))), logits, 0)
