"""Activation-recompute policies as the frameworks configure them: the spec value's grammar and the op list of
op-level selective checkpointing (pure Python: the spec, the analytic model and the engine share it).

| spec value  | what is checkpointed (torch.utils.checkpoint, non-reentrant)       | framework                        |
|-------------|--------------------------------------------------------------------|----------------------------------|
| none        | nothing                                                            |                                  |
| selective   | the attention core (QK^T, softmax, xV) of every block              | Korthikanti et al. 2022          |
| full        | every block (its input saved, the block re-run in backward)        | torchtitan mode=full             |
| op          | every block, saving the outputs of the ops in `recompute_ops`      | torchtitan selective_ac_         |
|             | except every second aten.mm (create_selective_checkpoint_contexts) | option="op"                      |
| layers:K    | every K-th block of each stage module (K-th, 2K-th, ...)           | torchtitan selective_ac_         |
|             |                                                                    | option="K"                       |
| block:N     | the first N blocks of each stage module, one checkpoint each       | Megatron --recompute-method      |
|             |                                                                    | block --recompute-num-layers N   |
| uniform:N   | consecutive groups of N blocks of each stage module, one           | Megatron --recompute-method      |
|             | checkpoint per group                                               | uniform --recompute-num-layers N |

torchtitan counts layer-SAC blocks with one counter per process across its model chunks; here the count restarts in
every stage module (the same for one chunk per rank).
"""

from __future__ import annotations

import re

NAMED = ("none", "selective", "full", "op")
WITH_LAYERS = ("layers", "block", "uniform")
KINDS = NAMED + WITH_LAYERS
"""Policy kinds in the analytic model's code order (analytic/layout.RecomputeMode)."""

TORCHTITAN_SAC_OPS = (
    "aten.mm.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "aten.max.default",
)
"""torchtitan's `_op_sac_save_list` (torchtitan/models/llama3/infra/parallelize.py), the ops its op-level SAC saves
(flex attention and inductor's compiled-code HOP left out: ShardLab runs neither)."""
CPU_FLASH_OP = "aten._scaled_dot_product_flash_attention_for_cpu.default"
DEFAULT_SAC_OPS = TORCHTITAN_SAC_OPS + (CPU_FLASH_OP,)
"""torchtitan's list plus the CPU flash kernel (torchtitan lists only the CUDA one; on a CPU rank that kernel is
what torchtitan's choice to save the attention output means)."""
KNOWN_SAC_OPS = DEFAULT_SAC_OPS + ("aten.addmm.default", "aten.bmm.default")
"""Ops whose saved outputs the analytic model counts (analytic/memory/activations.op_sac_saved_bytes)."""

_GRAMMAR = re.compile(r"(none|selective|full|op)|(layers|block|uniform):([1-9][0-9]{0,5})")


def parse(value: str) -> tuple[str, int]:
    """'layers:2' -> ('layers', 2); 'full' -> ('full', 0). ValueError naming the grammar otherwise."""
    m = _GRAMMAR.fullmatch(str(value).strip())
    if not m:
        raise ValueError(f"recompute {value!r} is not one of none, selective, full, op, layers:K, block:N, uniform:N "
                         "(K, N >= 1 blocks)")
    return (m.group(1), 0) if m.group(1) else (m.group(2), int(m.group(3)))


def spelled(kind: str, layers: int = 0) -> str:
    """The spec value of (kind, layers)."""
    return f"{kind}:{layers}" if kind in WITH_LAYERS else kind


def ops_problem(ops: list[str] | tuple[str, ...]) -> str | None:
    """Why an op list cannot be used (an op the analytic model does not count), or None."""
    unknown = [op for op in ops if op not in KNOWN_SAC_OPS]
    if unknown:
        return (f"recompute_ops {unknown} not among the ops ShardLab predicts: {', '.join(KNOWN_SAC_OPS)}")
    return None


def groups(n_blocks: int, kind: str, layers: int) -> list[tuple[range, bool]]:
    """(block positions, checkpointed) runs of a stage module's n blocks, in forward order."""
    if kind in ("full", "op"):
        return [(range(j, j + 1), True) for j in range(n_blocks)]
    if kind == "layers":  # torchtitan's layer SAC: the K-th, 2K-th, ... block
        return [(range(j, j + 1), (j + 1) % layers == 0) for j in range(n_blocks)]
    if kind == "block":  # Megatron --recompute-method block: the first N blocks, each its own checkpoint
        return [(range(j, j + 1), j < layers) for j in range(n_blocks)]
    if kind == "uniform":  # Megatron --recompute-method uniform: chunks of N blocks, one checkpoint per chunk
        return [(range(j, min(j + layers, n_blocks)), True) for j in range(0, n_blocks, layers)]
    return [(range(0, n_blocks), False)] if n_blocks else []
