"""Per-rank communication per optimizer step, by collective, as ShardLab's strategies issue it (pure Python).

Payload = bytes of the buffer handed to the collective (docs/ARCHITECTURE.md: all_reduce the tensor,
all_gather the gathered output, reduce_scatter the full input, all_to_all the input, send/recv the
tensor). Each entry is (collective, payload bytes per step, group size) so ring wire bytes can be
derived with `comm.ring_wire_bytes`. DDP all-reduces once per step (no_sync on earlier microbatches);
FSDP2 reduce-scatters after every microbatch (backend/strategies/data_parallel.py) except under pipelining,
which syncs on the last backward only; it all-gathers a unit at each sharded -> unsharded transition
(`fsdp_gathers_per_step`).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from backend.analytic.dp_buckets import bucket_numels, used_by
from backend.analytic.ep_dispatch import Dispatch, all_to_all_payload_bytes, allgather_bytes, megatron_expert_tp_bytes
from backend.analytic.layout import Layout
from backend.analytic.params import ModelKey, block_param_list, is_gated, model_key, n_moe_layers
from backend.analytic.scalar_or_array import maximum, where
from backend.analytic.sharding import LocalParam, fsdp_units, unsharded_numel
from backend.analytic.tp_placement import module_rule
from backend.spec.stack_rules import loss_parallel_on

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ExperimentSpec, ModelSpec

MASTER_BYTES = 4  # torch parameters, gradients and optimizer states stay fp32 in every precision mode
FP8_BYTES = 1  # float8_e4m3fn / e5m2
# torch DDP bucket_cap_mb=25 (Li et al. 2020 Sec 3.2.3); ep.sync_expert_grads buckets alike
DDP_BUCKET_BYTES = 25 * 2**20

Traffic = list[tuple[str, float, int]]


def compute_bytes(precision: str) -> int:
    """Bytes of activations / unsharded FSDP params / TP and PP payloads: 2 under bf16/fp16 mixed, else 4."""
    return 4 if str(precision) == "fp32" else 2


def uses_replicate(spec: ExperimentSpec) -> bool:
    """ddp on the dp dimension of a tp/pp mix is FSDP2 `replicate` (data_parallel.composable_wrap); ep alone uses
    classic DDP."""
    p = spec.parallel
    return p.dp_cp > 1 and p.zero_stage == 0 and (p.tp > 1 or p.pp > 1)


def is_mix(spec: ExperimentSpec) -> bool:
    """tp/pp/ep > 1: the dp dimension is wrapped by backend/strategies/data_parallel.composable_wrap (FSDP2 `replicate`
    for ddp, `fully_shard` without a MixedPrecisionPolicy for zero2/zero3)."""
    p = spec.parallel
    return p.tp > 1 or p.pp > 1 or p.ep > 1


def fsdp_param_bytes(spec: ExperimentSpec) -> int:
    """Bytes per unsharded FSDP2 element: MixedPrecisionPolicy.param_dtype in the pure fsdp/zero2 strategies
    (backend/strategies/data_parallel.py), fp32 in the mixes (no policy)."""
    return MASTER_BYTES if is_mix(spec) else compute_bytes(spec.train.precision)


def fsdp_gathers_per_step(zero_stage: Num, microbatches: Num, *, pipelined: Num) -> Num:
    """All-gathers of one FSDP2 unit per step = its sharded -> unsharded transitions.

    Without pipelining every microbatch gathers before forward, and zero3 (reshard_after_forward=True)
    again before backward; every backward reshards (ZeRO Sec 7.2.2). Under pipelining
    (torch/distributed/pipelining/stage.py `backward_maybe_with_nosync`) every backward runs with
    reshard_after_backward=False, and only `perform_reduce_grad` after the last one reshards: zero2 gathers
    once per step; zero3 gathers for the first forward and, since each forward reshards, for whatever
    action follows a forward (a forward after a backward finds the unit unsharded), so 1 + microbatches."""
    zero2 = zero_stage == 2
    return where(pipelined, where(zero2, 1, 1 + microbatches), where(zero2, 1, 2) * microbatches)


def is_float8_weight(q: LocalParam) -> bool:
    """A weight precision fp8 runs as a torchao float8 linear (strategies/float8.py: the blocks' Linears but the MoE
    router, experts and shared-expert gate)."""
    name = q.name
    return name.startswith("layers.") and name.endswith(".weight") and len(q.shape) == 2 \
        and ".mlp.router" not in name and ".experts." not in name and not name.endswith("shared_gate.weight")


def dp_traffic(spec: ExperimentSpec, params: Sequence[LocalParam]) -> Traffic:
    """(collective, payload bytes, group size) of data-parallel gradient / parameter traffic per step."""
    p, t = spec.parallel, spec.train
    out: Traffic = []
    by_group: dict[int, list[LocalParam]] = {}
    for q in params:
        if q.is_expert and p.ep > 1:
            continue
        if q.dp_group > 1:
            by_group.setdefault(q.dp_group, []).append(q)
    experts = [q for q in params if q.is_expert and p.ep > 1]
    if experts and experts[0].dp_group > 1 and used_by(spec):  # the distributed optimizer's expert buckets over edp
        edp = experts[0].dp_group
        total = sum(bucket_numels(experts, edp, edp))
        out += [("reduce_scatter", MASTER_BYTES * total, edp), ("all_gather", compute_bytes(t.precision) * total, edp)]
    elif experts and experts[0].dp_group > 1:  # ep.sync_expert_grads: 25 MB buckets + a 4 B flag per tensor
        out.append(("all_reduce", MASTER_BYTES * (sum(q.local_numel for q in experts) + len(experts)),
                    experts[0].dp_group))
    for n, group in by_group.items():
        if used_by(spec):  # the distributed optimizer: per bucket one reduce-scatter of the fp32 grads (payload = the
            total = sum(bucket_numels(group, n))  # padded bucket), one all-gather of the params (the gathered output)
            out += [("reduce_scatter", MASTER_BYTES * total, n), ("all_gather", compute_bytes(t.precision) * total, n)]
            continue
        if p.zero_stage <= 1:
            grad = MASTER_BYTES * sum(q.local_numel for q in group)
            out.append(("all_reduce", grad, n))  # DDP: one all-reduce of every gradient (ZeRO Sec 7.1)
            if p.zero_stage == 1:
                out.append(("broadcast", grad, n))  # ZeroRedundancyOptimizer._sync_params: each param from its owner
            continue
        cb = fsdp_param_bytes(spec)  # all-gather in the param dtype; reduce_dtype is fp32
        gathers = fsdp_gathers_per_step(p.zero_stage, t.microbatches, pipelined=p.pp > 1)
        syncs = 1 if p.pp > 1 else t.microbatches  # pipelining syncs on the last backward only
        fp8 = bool(getattr(t, "fp8_gathers", False))
        for unit in fsdp_units(spec.model, group).values():
            full = unsharded_numel(unit)
            # fp8 all-gather (torchao enable_fsdp_float8_all_gather): the float8 linears' weights travel as 1-byte
            gathered = full * cb - (unsharded_numel([q for q in unit if is_float8_weight(q)]) * (cb - FP8_BYTES) if fp8
                                    else 0)
            out.append(("all_gather", gathers * gathered, n))  # payload = gathered output (ZeRO Sec 7.2.2)
            out.append(("reduce_scatter", syncs * full * MASTER_BYTES, n))  # payload = full padded gradient input
        if fp8:  # precompute_float8_dynamic_scale_for_fsdp: one all-reduce of every float8 weight's fp32 amax per step
            out.append(("all_reduce", MASTER_BYTES * sum(1 for q in group if is_float8_weight(q)), n))
    return out


def tp_traffic(spec: ExperimentSpec, layers: list[int], stages: list[int]) -> Traffic:
    """TP activation collectives per step, following backend/strategies/tp.py `tp_plan`."""
    m, t, p = spec.model, spec.train, spec.parallel
    cb, mb, n = compute_bytes(t.precision), t.microbatches, p.tp
    s = m.seq_len // p.cp  # this rank's tokens of each sequence
    bsh, sh = t.micro_batch * s * m.d_model * cb, s * m.d_model * cb
    if str(getattr(m, "positions", "learned")) == "rope":
        sh = 0  # no pos_emb: RoPE has no parameters and no collective
    sp, L = p.sequence_parallel, len(layers)
    dispatch = Dispatch.of_spec(spec)
    megatron = dispatch.megatron
    moe = n_moe_layers(m, layers)  # each block by its own kind: a dense prefix / interleave mixes the two
    ar = ag = rs = 0.0
    # Shoeybi 2019 Sec 3: per layer f/g operators, 2 all-reduces fwd (o, fc_out) + 2 bwd (qkv, fc_in inputs);
    # Korthikanti 2022 Sec 4.2.2: with SP each becomes an all-gather + a reduce-scatter of the same (b, s, h)
    if moe:  # per-expert Colwise/Rowwise: all-reduces over the routed rows (b*s*top_k, h), fwd + bwd
        # SwiGLU experts: gate and up each turn their plain input into a Replicate DTensor, so the backward
        # all-reduces twice (3 per expert call); the shared experts are one more such MLP on all b*s tokens
        mats = 3 if is_gated(getattr(m, "mlp", "gelu")) else 2
        if p.ep == 1 and not megatron:  # ep > 1: whole routed experts on every tp rank (expert_layout.py, etp 1)
            ar += mats * moe * bsh * m.top_k
        if getattr(m, "n_shared_experts", 0):
            ar += mats * moe * bsh
    if sp:  # tp.py `MoESequenceParallel`: Shard(1)->Replicate input (fwd all-gather, bwd local slice) and
        # Replicate->Shard(1) output (fwd local slice, bwd all-gather): a MoE block has 2 all-gathers, no reduce-scatter
        ag, rs = ag + 4 * L * bsh, rs + (4 * L - 2 * moe) * bsh
    else:
        ar += (4 * L - 2 * moe) * bsh
    n_stages = p.pp * p.virtual_stages
    if 0 in stages:  # RowwiseParallel embeddings: partial sums -> Replicate (all-reduce) or Shard (reduce-scatter)
        if sp:
            rs, ag = rs + bsh + sh, ag + bsh + sh  # backward all-gathers the sharded output grads
        else:
            ar += bsh + sh
    if n_stages - 1 in stages:
        if loss_parallel_on(spec):  # vocab-parallel loss: the logits stay sharded; it all-reduces per token the max,
            # the sum of exponentials and the target logit (torch's loss_parallel _log_softmax / _nll_loss_forward,
            # Megatron's VocabParallelCrossEntropy): 3 fp32 all-reduces of b*s values
            ar += 3 * t.micro_batch * s * MASTER_BYTES
        else:  # ColwiseParallel lm_head with Replicate output: logits all-gathered
            ag += t.micro_batch * s * m.vocab_size * cb
        if sp:
            ag, rs = ag + bsh, rs + bsh  # Shard(1) input gathered fwd, grad reduce-scattered bwd
        else:
            ar += bsh  # Replicate input: grad all-reduced in backward
    out = [(k, v * mb, n) for k, v in (("all_reduce", ar), ("all_gather", ag), ("reduce_scatter", rs)) if v]
    etp = p.tp if p.ep == 1 else p.etp
    own_gather = p.ep == 1 or str(m.moe_dispatcher) == "alltoall"  # allgather / flex: over tp x ep (ep_traffic)
    if moe and etp > 1 and megatron and own_gather:  # the dispatcher's gather before the experts, scatter after
        sent = dispatch.tokens(t.micro_batch * s, p.tp, sp)
        gathered = 2 * moe * mb * megatron_expert_tp_bytes(m, sent, cb, etp)  # forward and backward
        out += [("all_gather", gathered, etp), ("reduce_scatter", gathered, etp)]
    elif moe and p.ep > 1 and p.etp > 1:  # experts split over etp (expert_layout.py): their colwise / rowwise
        # all-reduces over the etp group, of the routed rows every etp rank holds alike (the MoE input is whole)
        out.append(("all_reduce", mats * moe * bsh * m.top_k * mb, p.etp))
    block, final = partial_grad_numel(model_key(m), sp)
    partial = block * L + final * (n_stages - 1 in stages)
    if partial:  # Partial grads over tp: one fp32 all-reduce per tensor per step (step.reduce_partial_grads)
        out.append(("all_reduce", partial * MASTER_BYTES, n))
    return out


@lru_cache(maxsize=256)
def partial_grad_numel(key: ModelKey, sp: bool) -> tuple[int, int]:
    """(per block, final norm) elements of the tp-replicated parameters whose gradients are partial sums over tp and
    get summed once per step (tp_placement rules): SequenceParallel norms under SP (ln1, ln2, Gemma's post norms, the
    final norm; Korthikanti 2022 Sec 4.2.2) and, with or without SP, the `partial_grads` ones (q / k norms, MLA's
    latent projections and their norms). Blocks differ only by their MLP, which holds none of these."""
    def partial(module: str) -> bool:
        rule = module_rule(module)
        return rule is not None and (rule.partial_grads or (sp and rule.sequence_norm))

    block = sum(q.numel for q in block_param_list(key, 0) if ".mlp." not in q.name and partial(q.module))
    final = key.d_model * (2 if key.norm == "layernorm" else 1) if partial("norm") else 0
    return block, final


def model_parallel_traffic(spec: ExperimentSpec, layers: list[int], stages: list[int]) -> Traffic:
    m, t, p = spec.model, spec.train, spec.parallel
    tokens = t.micro_batch * m.seq_len // p.cp  # this rank's tokens of a microbatch
    act = tokens * m.d_model * compute_bytes(t.precision)  # one (b, s, h) activation
    if p.tp > 1 and p.sequence_parallel:
        act /= p.tp  # under SP a stage boundary carries the sequence-sharded local (b, s/t, h) tensor
    mb = t.microbatches
    out = tp_traffic(spec, layers, stages) if p.tp > 1 else []
    out += ep_traffic(spec, layers)
    if p.pp > 1:
        n_stages, mine = p.pp * p.virtual_stages, set(stages)
        for s in stages:
            for nb in (s - 1, s + 1):  # Narayanan 2021 Sec 3.2: b*s*h per microbatch per boundary, each way
                if 0 <= nb < n_stages and nb not in mine:
                    out += [("send", act * mb, 2), ("recv", act * mb, 2)]
    return out


def ep_rows(spec: ExperimentSpec, layers: list[int]) -> tuple[int, int, int]:
    """(tokens one rank dispatches per microbatch, bytes per row element, microbatches x MoE blocks of `layers`): the
    rows and their dtype as the stack's dispatcher sends them (ep_dispatch.Dispatch)."""
    m, t, p = spec.model, spec.train, spec.parallel
    dispatch = Dispatch.of_spec(spec)
    sent = dispatch.tokens(t.micro_batch * m.seq_len // p.cp, p.tp, p.sequence_parallel)
    return sent, dispatch.row_bytes(t.precision), t.microbatches * n_moe_layers(m, layers)


def ep_traffic(spec: ExperimentSpec, layers: list[int]) -> Traffic:
    """The EP dispatch and combine of this rank's MoE blocks per step, by dispatcher (ep_dispatch.py): the alltoall
    dispatcher's all-to-alls (its rows and their dtype as the stack sends them, and the engine's E int64 counts
    exchanged first, forward only: backend/strategies/moe_dispatch.py); the allgather dispatcher's all-gathers and
    reduce-scatters over the tp x ep group; the flex dispatcher's rows before DeepEP / HybridEP deduplicate them per
    rank and node (which depends on the node size: the step time counts the deduplicated sends, steptime/ep_comm.py)."""
    m, p = spec.model, spec.parallel
    if p.ep == 1 or not m.is_moe:
        return []
    sent, row_bytes, passes = ep_rows(spec, layers)
    if str(m.moe_dispatcher) == "allgather":
        each = 2 * passes * allgather_bytes(m, sent, row_bytes, p.etp * p.ep)
        return [("all_gather", each, p.etp * p.ep), ("reduce_scatter", each, p.etp * p.ep)]
    counts = 8 * m.n_experts if str(m.moe_dispatcher) == "alltoall" else 0
    return [("all_to_all", (float(all_to_all_payload_bytes(m, sent, row_bytes)) + counts) * passes, p.ep)]


TE_RING_SOURCE = ("Transformer Engine d0067d0d transformer_engine/pytorch/attention/dot_product_attention/"
                  "context_parallel.py: AttnFuncWithCPAndKVP2P (p2p_comm_buffers of kv.dtype holding K/V, then K/V "
                  "and dK/dV together, then dK/dV) and AttnFuncWithCPAndKVAllGather (gather_along_first_dim of K/V, "
                  "reduce_scatter_along_first_dim of dK/dV); Megatron-Core d98e8a6 "
                  "megatron/core/extensions/transformer_engine.py TEDotProductAttention: cp_comm_type None -> 'p2p' "
                  "(l. 2141-2142), K/V at num_query_groups_per_partition heads")
"""Where the megatron stack's ring comes from (cp_ring.py times it)."""


def cp_ring_bytes(model: ModelSpec, layout: Layout) -> tuple[Num, Num]:
    """(K and V one attention call moves per hop on one rank, their gradients): b * s/cp * heads/t * d_head each.
    torch's `_templated_ring_attention` (stacks shardlab, torchtitan, deepspeed): GQA K/V repeated to the query heads
    before the core (torchtitan's repeat_kv until ff0829c, 2026-01-27), dK/dV accumulated and sent in fp32.
    Transformer Engine's (stack megatron, TE_RING_SOURCE): K/V at the GQA width, dK/dV in the compute dtype."""
    te = layout.te_ring
    heads = maximum(model.kv_heads // layout.tp, 1) if te else model.n_heads // layout.tp
    elems = 2 * layout.micro_batch * layout.seq_local(model) * heads * model.head_dim
    return elems * layout.compute_bytes, elems * (layout.compute_bytes if te else MASTER_BYTES)


def cp_kv_bytes(spec: ExperimentSpec) -> tuple[float, float]:
    """`cp_ring_bytes` of a spec."""
    return cp_ring_bytes(spec.model, Layout.of(spec))


def cp_traffic(spec: ExperimentSpec, n_layers: int) -> Traffic:
    """Ring attention's K/V traffic per step over the cp group, per layer and microbatch (cp_ring.py times it).
    torch's ring (strategies/ring_attention.py, torch's _templated_ring_attention): forward allgather = 1 all_gather
    (output cp x K/V) or alltoall = cp - 1 all_to_all of K/V; backward the same again plus cp all_to_all of the fp32
    dK/dV accumulators. Transformer Engine's (stack megatron): allgather = the same all_gathers and one
    reduce_scatter of the cp x dK/dV; p2p (alltoall) = cp - 1 hops of K/V each way and cp - 1 of dK/dV.
    Recompute (full, or selective's checkpointed core) re-runs the forward's share in backward."""
    p, t = spec.parallel, spec.train
    layout = Layout.of(spec)
    kv, dkv = cp_ring_bytes(spec.model, layout)
    calls = n_layers * t.microbatches * (2 if str(t.recompute) != "none" else 1)  # forward runs (incl. re-runs)
    bwd = n_layers * t.microbatches
    te = layout.te_ring
    if str(p.cp_rotate) == "allgather":
        gathers = ("all_gather", (calls + bwd) * p.cp * kv, p.cp)
        return [gathers, ("reduce_scatter", bwd * p.cp * dkv, p.cp)] if te else \
            [gathers, ("all_to_all", bwd * p.cp * dkv, p.cp)]
    grads = bwd * (p.cp - 1 if te else p.cp) * dkv
    return [("all_to_all", (calls + bwd) * (p.cp - 1) * kv + grads, p.cp)]


def rank_traffic(spec: ExperimentSpec, params: list[LocalParam], layers: list[int], stages: list[int]) -> Traffic:
    """All of one rank's traffic: data-parallel sync of its local tensors + TP / EP / PP activations + CP's K/V."""
    ring = cp_traffic(spec, len(layers)) if spec.parallel.cp > 1 else []
    return (dp_traffic(spec, params) + buffer_traffic(spec, layers) + model_parallel_traffic(spec, layers, stages)
            + ring
            + tied_embedding_traffic(spec, params))


def buffer_traffic(spec: ExperimentSpec, layers: list[int]) -> Traffic:
    """Classic DistributedDataParallel (data_parallel.classic_wrap: pure ddp / zero1, and ddp with ep) broadcasts the
    module buffers from rank 0 before the first forward after a synced backward (broadcast_buffers=True; the no_sync
    microbatches skip it): once per step, over the dp x cp ranks. The only buffer is DeepSeek-V3's per-expert balance
    bias (fp32, n_experts per MoE block), replicated like the router."""
    p, m = spec.parallel, spec.model
    classic = p.dp_cp > 1 and p.zero_stage <= 1 and p.tp == 1 and p.pp == 1 and not (p.zero_stage == 1 and p.ep > 1)
    if not (classic and getattr(m, "router_balance_bias", False)):
        return []
    return [("broadcast", MASTER_BYTES * m.n_experts * n_moe_layers(m, layers), p.dp_cp)]


def tied_embedding_traffic(spec: ExperimentSpec, params: list[LocalParam]) -> Traffic:
    """Tied embeddings under PP (backend/strategies/pp.py `tied_embedding_sync`, Megatron's embedding-group
    all-reduce): the first stage's tok_emb grad and the last stage's lm_head copy are all-reduced once per step
    between the two ranks, fp32 local (TP- and FSDP-sharded) grad, unless one rank holds both stages."""
    held = [q for q in params if q.name == "tok_emb.weight" or (q.name == "lm_head.weight"
                                                                 and getattr(spec.model, "tie_embeddings", False))]
    if not getattr(spec.model, "tie_embeddings", False) or spec.parallel.pp == 1 or len(held) != 1:
        return []
    return [("all_reduce", held[0].storage_numel * MASTER_BYTES, 2)]
