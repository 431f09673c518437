"""Issue 32 on the stacks: an FSDP2 stack rank's moment inside backward (memory/stack_backward.py) and FSDP2's
gradients accumulated in reduce_dtype between pipelined backwards (memory/stack_states.fsdp2_state), each against the
arithmetic of torch's FSDP2 source."""

from __future__ import annotations

from dataclasses import replace

import pytest

from backend.analytic.device import with_device
from backend.analytic.layout import Layout, RankPosition
from backend.analytic.memory.activations import LayerShape
from backend.analytic.memory.backward_moment import block_extra
from backend.analytic.memory.rank_memory import rank_memory
from backend.analytic.memory.stack_activations import block_terms, stack_blocks
from backend.analytic.memory.stack_states import stack_model_state
from backend.analytic.params import block_params
from backend.spec import ExperimentSpec

pytestmark = pytest.mark.unit

WIDE = {"vocab_size": 512, "d_model": 1024, "n_layers": 4, "n_heads": 8, "ffn_hidden": 4096, "seq_len": 64,
        "norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": "none", "attention": "flash",
        "tie_embeddings": False}
"""Big blocks, short sequences: what FSDP2 gathers in backward outweighs the activations."""


def _spec(parallel: dict, **train) -> ExperimentSpec:
    return with_device(ExperimentSpec.for_prediction({
        "model": WIDE, "parallel": parallel,
        "train": {"global_batch": 8, "micro_batch": 1, "precision": "bf16-mixed", "stack": "torchtitan"} | train}),
        "cuda")


def _memory(spec: ExperimentSpec, rank: int = 0):
    layout = Layout.of(spec)
    position = RankPosition.of_rank(spec, rank)
    return layout, position, rank_memory(spec.model, layout, position)


def test_the_fsdp2_backward_holds_two_gathered_blocks_their_grads_and_the_reduce_scatter_input():
    """zero3 over 4 ranks, no recompute: the second block back-propagated holds the root, the working and the
    prefetched blocks' bf16 parameters, the working block's bf16 gradients, the block before's fp32 reduce-scatter
    input and the root's bf16 gradients, over the resting state and the blocks still saved."""
    spec = _spec({"strategy": "zero3", "world_size": 4})
    layout, position, mem = _memory(spec)
    parts = mem.parts
    rest = stack_model_state(spec.model, layout, position, parts, unsharded=False)
    resting = rest.params_bytes + rest.grads_bytes + rest.optimizer_bytes + mem.other_bytes
    held = stack_blocks(spec.model, layout, 0, parts).held
    plain = block_terms(spec.model, layout)[0]
    blk = block_params(spec.model, 0)
    root = parts.embeddings.fsdp_unsharded_numel + parts.head.fsdp_unsharded_numel
    assert parts.last_block.fsdp_unsharded_numel == blk
    fixed = 2 * (root + 2 * blk) + 2 * blk + 2 * parts.head.fsdp_unsharded_grad_numel
    second = resting + held - plain + fixed + 4 * blk
    first = resting + held + fixed
    shape = replace(LayerShape.prototype(spec.model, dtype_bytes=2, device="cuda"), flash=True)
    work = block_extra(shape, False)[0]  # the working block's backward tensors (block_backward.py's eager ledger)
    assert mem.backward_bytes == max(first, second) + work
    assert mem.fullest_bytes == mem.backward_bytes > mem.total_bytes  # the fullest moment is inside backward


def test_a_pipelined_fsdp2_rank_accumulates_its_unsharded_grads_in_reduce_dtype():
    """Under pipelining FSDP2 skips the reduce-scatter until the last microbatch and keeps each unit's unsharded
    gradient upcast to reduce_dtype (_fsdp_param.py to_accumulated_grad_if_needed): fp32 by torchtitan's default,
    bf16 when the reduce dtype is set so."""
    par = {"strategy": "zero2", "world_size": 4, "pp": 2}
    fp32 = _memory(_spec(par))[2]
    bf16 = _memory(_spec(par, grad_reduce_dtype="bf16"))[2]
    unsharded_grads = fp32.grads_bytes - bf16.grads_bytes
    assert unsharded_grads > 0
    stage = fp32.parts.total("fsdp_unsharded_grad_numel")
    assert unsharded_grads == 2 * stage  # 4 B against 2 B per accumulated element
    assert fp32.backward_bytes == 0  # the pipelined stack rank's backward moment is not modelled
