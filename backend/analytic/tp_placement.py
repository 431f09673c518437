"""THE tensor-parallel placement of every module of backend/models/gpt.py: one table (pure Python) from which both
the analytic sharding (sharding.tp_style / tp_local_shape) and the DTensor plan the engine applies
(strategies/tp.tp_plan) are built, so the two cannot drift apart.

Megatron layout (Shoeybi et al. 2019, Sec 3, Fig 3): the first GEMM of attention and MLP splits its output features
(ColwiseParallel: weight rows + bias), the second splits its input features (RowwiseParallel: weight columns, bias
replicated). Embeddings are RowwiseParallel over their rows (vocab / positions), lm_head ColwiseParallel (vocab
rows) with its logits gathered (Replicate output). SwiGLU (Shazeer 2020): gate and up split like fc_in, down like
fc_out; the routed and shared experts split like the dense MLP but inside the MoE's own gather / scatter. Norms
replicate their parameters (SequenceParallel under SP); anything unmatched (the MoE router, shared_gate) is a
plain replicated parameter. With sequence parallelism (Korthikanti et al. 2022 Sec 4.2.2) the layouts named
`input_sp` / `output_sp` replace `input` / `output`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

COLWISE, ROWWISE, REPLICATE, VOCAB_ROWWISE = "colwise", "rowwise", "replicate", "embedding_rowwise"
HEADS = "heads"
"""A per-head parameter vector (gpt-oss's sinks) split along dim 0 like q's output rows."""
SEQUENCE = "sequence"
"""Activations sharded along the sequence (Shard(1) of (B, T, C))."""
POSITIONS = "positions"
"""The position embedding's (T, C) output sharded along T (Shard(0))."""


@dataclass(frozen=True)
class TpRule:
    module: str
    """Regex of the module path (full match; layer and expert ids as \\d+)."""
    placement: str
    """How the module's parameters are split: COLWISE, ROWWISE, VOCAB_ROWWISE or REPLICATE."""
    input: str | None = None
    """Layout of the module's input (None: the style's default)."""
    input_sp: str | None = None
    """... under sequence parallelism (None: as `input`)."""
    output: str | None = None
    output_sp: str | None = None
    sequence_norm: bool = False
    """A norm whose replicated parameters see sequence-sharded activations under SP (SequenceParallel)."""
    local_output: bool = False
    """SequenceParallel hands back a local tensor (Gemma's post-sublayer norms, whose output meets the local
    residual)."""
    partial_grads: bool = False
    """Replicated parameters applied to head-split activations (q / k norms, MLA's latent projections): each tp rank's
    gradient is a partial sum, so they are Replicate DTensors whose grads are summed over tp (Megatron all-reduces
    these layernorm / latent grads likewise)."""


TP_PLACEMENT: tuple[TpRule, ...] = (
    TpRule(r"tok_emb", VOCAB_ROWWISE, input=REPLICATE, output=REPLICATE, output_sp=SEQUENCE),
    TpRule(r"pos_emb", VOCAB_ROWWISE, input=REPLICATE, output=REPLICATE, output_sp=POSITIONS),
    TpRule(r"layers\.\d+\.ln[12]", REPLICATE, sequence_norm=True),
    TpRule(r"layers\.\d+\.ln[12]_post", REPLICATE, sequence_norm=True, local_output=True),
    TpRule(r"layers\.\d+\.attn\.[qkv]", COLWISE),
    TpRule(r"layers\.\d+\.attn\.(q_norm|k_norm|q_a|q_a_norm|kv_a|kv_a_norm)", REPLICATE, partial_grads=True),
    TpRule(r"layers\.\d+\.attn\.(q_b|kv_b)", COLWISE),
    TpRule(r"layers\.\d+\.attn\.sinks", HEADS),
    TpRule(r"layers\.\d+\.attn\.o", ROWWISE, output_sp=SEQUENCE),
    TpRule(r"layers\.\d+\.mlp\.(fc_in|gate|up)", COLWISE),
    TpRule(r"layers\.\d+\.mlp\.(fc_out|down)", ROWWISE, output_sp=SEQUENCE),
    TpRule(r"layers\.\d+\.mlp\.(experts\.\d+|shared)\.(fc_in|gate|up)", COLWISE),
    TpRule(r"layers\.\d+\.mlp\.(experts\.\d+|shared)\.(fc_out|down)", ROWWISE),
    TpRule(r"norm", REPLICATE, sequence_norm=True),
    TpRule(r"lm_head", COLWISE, input=REPLICATE, input_sp=SEQUENCE, output=REPLICATE),
)


BLOCK_INPUT_LINEAR = re.compile(r"layers\.\d+\.(attn\.[qkv]|mlp\.(fc_in|gate|up))\.weight")
"""The column-parallel weights that read their block module's input (the attention's, the dense MLP's): the SP
all-gather feeds them, several of them one input."""
OUTPUT_PROJECTION = re.compile(r"layers\.\d+\.(attn\.o|mlp\.(fc_out|down))\.weight")
"""The row-parallel weights that end the attention and the dense MLP: the SP reduce-scatter follows them."""


@lru_cache(maxsize=1 << 16)
def module_rule(module: str) -> TpRule | None:
    """The rule of a module path (None: not in the table, a plain replicated module)."""
    for rule in TP_PLACEMENT:
        if re.fullmatch(rule.module, module):
            return rule
    return None


def module_placement(module: str) -> str:
    rule = module_rule(module)
    return rule.placement if rule else REPLICATE
