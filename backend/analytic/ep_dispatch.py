"""What one rank's expert-parallel dispatch carries, by stack (pure Python): how many of its tokens it dispatches, how
many bytes each row's element takes, the all-to-alls' payload, and (Megatron) the expert-TP gather and scatter around
them. The step-time model (traffic.model_parallel_traffic) and the planner's screen (steptime/screen.py) both read it.

- ShardLab's engine (stack shardlab) routes every token of its (b, s/cp) microbatch, and the rows are the ln2
  output: fp32 under torch.autocast (memory/moe_bytes.row_bytes; strategies/moe_dispatch.py).
- Megatron-Core's alltoall dispatcher (Megatron-LM d98e8a64ddf3, megatron/core/transformer/moe/token_dispatcher.py):
  the A2A over the EP group moves this rank's local tokens, "num_local_tokens: S/TP*B" under sequence parallelism
  (module notation, l. 55-58; MoEAlltoAllTokenDispatcher.token_dispatch, l. 705-717), in the layer's 16-bit dtype;
  expert TP all-gathers the received rows after it (dispatch_postprocess, l. 741-749), and FP8 is cast inside
  Transformer Engine's grouped GEMMs, after the all-to-all. Without sequence parallelism (Megatron warns that EP with
  TP needs it: core/model_parallel_config.py l. 560-565) every tp rank holds and sends the whole sequence.
  With expert TP (etp; tp when ep is 1) the dispatcher all-gathers the all-to-all's output over the expert tp group
  (`dispatch_postprocess`, gather_from_sequence_parallel_region) and reduce-scatters the experts' output before the
  combine all-to-all (`combine_preprocess`, reduce_scatter_to_sequence_parallel_region): Megatron-LM 0014f137,
  megatron/core/transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher. Backward runs each as the other.
  The experts' column / row-parallel GEMMs issue no collective of their own. ShardLab's engine instead all-reduces
  each expert's colwise / rowwise DTensor over etp (traffic.tp_traffic).
- torchtitan (FSDP2's MixedPrecisionPolicy computes in bf16) and DeepSpeed (a 16-bit module) hold 16-bit
  activations and dispatch their (b, s/cp) tokens, as this engine does.

The dispatcher (model.moe_dispatcher, Megatron-Core's --moe-token-dispatcher-type; token_dispatcher.py @ d98e8a64)
sets what crosses which link; the rows and their dtype above are the same for all three:
- alltoall (MoEAlltoAllTokenDispatcher): each (token, expert) row to the expert's rank, local rows included in the
  payload, over the ep group.
- allgather (MoEAllGatherTokenDispatcher, l. 233-372): every rank all-gathers the hidden states of its whole tp x ep
  group (`gather_from_sequence_parallel_region(..., group=self.tp_ep_group)`, l. 299-301) and reduce-scatters the
  experts' output back (l. 365-367); backward runs each as the other. `allgather_bytes`.
- flex (MoEFlexTokenDispatcher, l. 1809-1870, DeepEP or HybridEP kernels over the same tp x ep group): a token goes
  once to each rank that holds any of its experts, and across nodes once to each node that holds any of them, then
  over NVLink inside that node (DeepEP deep_ep/buffers/legacy.py @ dd758ca l. 309-313: `num_tokens_per_rank`,
  `num_tokens_per_rdma_rank`, `is_token_in_rank`). `flex_rows` counts those sends under uniform routing.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb
from typing import TYPE_CHECKING

import numpy as np

from backend.analytic.moe_rows import is_uniform_dropless
from backend.analytic.moe_rows import of_model as expert_rows_of
from backend.analytic.scalar_or_array import logical_and, per_distinct, where
from backend.analytic.textbook.comm_volume import ep_all_to_all_payload_bytes

if TYPE_CHECKING:
    from backend.analytic.layout import Layout
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ExperimentSpec, ModelSpec

ENGINE_ROW_BYTES = 4
"""The engine's routed rows under autocast: layer_norm's fp32 output (memory/moe_bytes.row_bytes)."""


@dataclass(frozen=True)
class Dispatch:
    """Whose dispatcher moves the routed rows."""

    engine: bool
    """ShardLab's own engine (stack shardlab): fp32 rows under autocast, the whole local sequence."""
    megatron: bool
    """Megatron-Core's alltoall dispatcher: 16-bit rows, the sequence-parallel shard of the tokens."""

    @classmethod
    def of_spec(cls, spec: ExperimentSpec) -> Dispatch:
        stack = str(getattr(spec.train, "stack", "shardlab"))
        return cls(engine=stack == "shardlab", megatron=stack == "megatron")

    @classmethod
    def of_layout(cls, layout: Layout) -> Dispatch:
        stack = layout.stack
        return cls(engine=stack is None, megatron=stack is not None and stack.mechanism == "megatron")

    def row_bytes(self, precision: str) -> int:
        """Bytes per element of a dispatched row: fp32 for the engine's autocast rows and for fp32 training, else the
        16-bit activations (fp8 GEMMs cast their inputs after the all-to-all)."""
        return 4 if self.engine or str(precision) == "fp32" else 2

    def ep_stride(self, tp: Num, etp: Num) -> Num:
        """Rank distance between neighbours of an EP group. This engine carves ep out of dp x cp, so its groups are
        strided by tp (expert_layout.py). Megatron lays the experts out on their own mesh, etp innermost, then ep
        (Megatron-LM parallel_state.py `initialize_model_parallel`: the expert RankGenerator with tp = etp, cp = 1,
        order tp-cp-ep-dp-pp): its groups are strided by etp, so with etp < tp an EP group folds over the tp ranks
        and fills a node with more members."""
        return etp if self.megatron else tp

    def tokens(self, tokens: Num, tp: Num, sequence_parallel: Num) -> Num:
        """This rank's dispatched tokens of a microbatch, from its (b, s/cp) `tokens`: Megatron's sequence-parallel
        shard (tokens / tp) where tp > 1 and sequence parallelism is on, else all of them."""
        if not self.megatron:
            return tokens
        return where(logical_and(tp > 1, sequence_parallel), tokens // tp, tokens)

    def layout_tokens(self, model: ModelSpec, layout: Layout) -> Num:
        """`tokens` of one layout's (b, s/cp) microbatch (one layout or arrays of them)."""
        return self.tokens(layout.micro_batch * layout.seq_local(model), layout.tp, layout.sequence_parallel)


def all_to_all_payload_bytes(model: ModelSpec, sent_tokens: Num, row_bytes: int) -> Num:
    """One MoE block's all-to-all input bytes for one microbatch, dispatch and combine, forward and backward (GShard
    Sec 3.1): `sent_tokens` x top_k rows each way under uniform dropless routing, else the rows the capacity limit and
    the imbalance leave (moe_rows.py: dispatch sends `sent`, combine sends back `received`)."""
    if is_uniform_dropless(model):
        return ep_all_to_all_payload_bytes(tokens=sent_tokens, h=model.d_model, top_k=model.top_k,
                                           dtype_bytes=row_bytes)
    rows = np.vectorize(lambda t: (lambda r: r.sent + r.received)(expert_rows_of(model, int(t))))(sent_tokens)
    return 2 * rows * model.d_model * row_bytes


def megatron_expert_tp_bytes(model: ModelSpec, sent_tokens: int, row_bytes: int, group: int) -> float:
    """Megatron's expert-TP all-gather (and, the same size, its reduce-scatter) of one MoE block and microbatch, in
    either pass: the rows this rank received from the all-to-all, gathered over the `group` expert tp ranks (payload =
    the gathered output, as traffic.py counts an all-gather)."""
    received = sent_tokens * model.top_k if is_uniform_dropless(model) else expert_rows_of(model, sent_tokens).received
    return received * group * model.d_model * row_bytes


def dispatch_group(layout: Layout) -> tuple[Num, Num]:
    """(members, rank stride) of the group the allgather and flex dispatchers use: Megatron's tp_ep group, etp x ep
    ranks. Its etp ranks are adjacent (expert tp innermost, Dispatch.ep_stride), so with etp > 1 the group is
    contiguous; with etp = 1 it is the ep group, strided as the stack lays out its experts."""
    stride = where(layout.etp > 1, 1, Dispatch.of_layout(layout).ep_stride(layout.tp, layout.etp))
    return layout.etp * layout.ep, stride


def _not_hit(n_experts: int, top_k: int, held: int) -> float:
    """P(none of a token's top_k distinct experts, drawn uniformly from n_experts, is among `held` of them)."""
    return comb(n_experts - held, top_k) / comb(n_experts, top_k) if held < n_experts else 0.0


def flex_rows(model: ModelSpec, group: Num, on_node: Num, etp: Num) -> tuple[Num, Num]:
    """(rows over NVLink, rows across nodes) that the flex dispatcher sends per dispatched token, one way, under
    uniform routing, over a group of `group` = etp x ep ranks with `on_node` of them per node. A rank holds the
    shards of n_experts / ep experts, a node n_experts x on_node / group distinct experts. A token crosses to
    (nodes - 1) x P(a node holds one of its experts) nodes, and goes over NVLink to the other ranks of its node that
    hold one, on its own node and, forwarded, on every other: (on_node - 1) x P(a rank holds one) x nodes."""

    def rows(g: int, members: int, shards: int) -> tuple[float, float]:
        e, k, nodes = model.n_experts, min(model.top_k, model.n_experts), max(1, g // members)
        rank_hit = 1 - _not_hit(e, k, e * shards // g)
        node_hit = 1 - _not_hit(e, k, e * members // g)
        return (members - 1) * rank_hit * nodes, (nodes - 1) * node_hit

    out = per_distinct(rows, group, on_node, etp)
    return (out[..., 0], out[..., 1]) if isinstance(out, np.ndarray) else out


def allgather_bytes(model: ModelSpec, sent_tokens: Num, row_bytes: int, group: Num) -> Num:
    """The allgather dispatcher's traffic of one MoE block and microbatch, each of its four collectives' payload: the
    hidden states of the whole tp x ep group gathered (forward; reduce-scatter in backward) and the experts' output of
    all of them reduce-scattered (forward; all-gather in backward). The gathered routing map and probs (n_experts
    bytes and 16-bit values per token) are left out."""
    return sent_tokens * group * model.d_model * row_bytes


def dispatcher_buffer_bytes(model: ModelSpec, layout: Layout) -> Num:
    """What the allgather dispatcher keeps on every rank once its first MoE block ran: the gathered hidden states of
    the tp x ep group, gathered into Megatron's global "mpu" buffer (token_dispatcher.py l. 299-301
    `use_global_buffer=True`; core/utils.py GlobalMemoryBuffer.get_tensor keeps the largest for the process's life).
    0 for the other dispatchers, without experts or at ep 1."""
    if not model.is_moe or str(model.moe_dispatcher) != "allgather":
        return 0
    dispatch = Dispatch.of_layout(layout)
    tokens = dispatch.layout_tokens(model, layout)
    group, _ = dispatch_group(layout)
    return where(layout.ep > 1, allgather_bytes(model, tokens, dispatch.row_bytes(str(layout.precision)), group), 0)
