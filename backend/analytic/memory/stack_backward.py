"""The fullest moment inside backward of a non-default stack's rank under FSDP2 (torchtitan's `fully_shard` with
MixedPrecisionPolicy), without pipelining (issue 32): what the activation peak does not hold.

At the end of forward every block but the last is resharded (torchtitan parallelize.py apply_fsdp:
reshard_after_forward for all but the last block). Its backward then holds, besides the activations the blocks saved
(the head's freed once its backward ran): the root's parameters (unsharded through backward), the working block's and
the prefetched next one's all-gathered parameters in param_dtype (`_fsdp_param_group.py` pre_backward /
`_backward_prefetch`), the working block's unsharded gradients in param_dtype, the reduce-scatter's input of the block
before in reduce_dtype (`_fsdp_collectives.foreach_reduce`: one kept, reduce_scatter_max_input_buffers = 1), the
root's gradients (reduced once the whole backward is done), and the working block's own backward tensors: a
checkpointed block re-run (its saved tensors again) and its backward's working set (block_backward.py's ledger, the
eager block at the stack's dtype). Two candidates: the first block back-propagated (the stage's last) and the second
(the first's reduce-scatter input alive). zero2 (reshard_after_forward=False) holds every unit unsharded instead.
The same reasoning as the engine's memory/backward_moment.py, priced in the stack's dtypes; pipelined layouts: 0
(not modelled for stacks).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from backend.analytic.layout import Layout, ZeroStage
from backend.analytic.memory.activations import LayerShape
from backend.analytic.memory.backward_moment import block_extra
from backend.analytic.memory.parts import RankParts
from backend.analytic.memory.stack_activations import StackBlocks
from backend.analytic.scalar_or_array import logical_and, logical_not, maximum, per_distinct, where

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec


def _working_set(model: ModelSpec, layout: Layout) -> Num:
    """One block's backward working set beyond its saved tensors (block_backward.py), the eager block in the stack's
    compute dtype, per distinct micro-batch, tp, SP and cp."""
    proto = LayerShape.prototype(model, dtype_bytes=layout.compute_bytes, device=layout.device, sac_ops=layout.sac_ops)

    def extra(b: int, tp: int, sp: int, cp: int) -> float:
        shape = replace(proto, micro_batch=b, tp=tp, sequence_parallel=bool(sp), autocast=False,
                        seq_len=proto.seq_len // cp, flash=layout.stack.fused_attention)
        return block_extra(shape, False)[0]  # its weight grads: block_grads below

    return per_distinct(extra, layout.micro_batch, layout.tp, layout.sequence_parallel, layout.cp)


def stack_backward_bytes(model: ModelSpec, layout: Layout, parts: RankParts, resting: Num,
                         blocks: StackBlocks) -> Num:
    """Total bytes at the fullest moment inside an FSDP2 stack rank's backward (module docstring); `resting`: its
    params, grads and optimizer with nothing unsharded, plus its inputs; `blocks`: what its blocks save
    (stack_activations.stack_blocks). 0 where the rank is not FSDP2 or is pipelined."""
    cb = layout.compute_bytes
    held, plain, unit, none, ck = blocks.held, blocks.plain, blocks.unit, blocks.rerun, blocks.ck
    stages = parts.stages
    n = stages.n_blocks
    extra = _working_set(model, layout)
    top_ckpt = logical_and(ck.units > 0, ck.after == 0)  # the stage's last block is a checkpoint unit
    top_saved = where(top_ckpt, unit, plain)
    second_ckpt = logical_and(ck.units > 0, ck.plain == 0)  # every block checkpointed (full, op, uniform)
    blk = parts.last_block.fsdp_unsharded_numel
    root = stages.first * parts.embeddings.fsdp_unsharded_numel + stages.last * parts.head.fsdp_unsharded_numel
    units = parts.total("fsdp_unsharded_numel")
    zero3 = layout.zero_stage == ZeroStage.ZERO3
    root_grads = cb * stages.last * parts.head.fsdp_unsharded_grad_numel
    block_grads = cb * parts.last_block.fsdp_unsharded_grad_numel

    def moment(removed: Num, rerun: Num, prefetch: Num, reduce_input: Num) -> Num:
        params = where(zero3, root + blk + where(prefetch, blk, 0), units)
        return (resting + held - removed + where(rerun, none, 0) + extra + cb * params + block_grads + root_grads
                + where(reduce_input, layout.stack.grad_bytes * blk, 0))

    first = moment(0, top_ckpt, n > 1, False)
    second = where(n > 1, moment(top_saved, second_ckpt, n > 2, True), 0)
    applies = logical_and(layout.fsdp, logical_not(layout.pipelined), n > 0)
    return where(applies, maximum(first, second), 0)
