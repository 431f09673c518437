"""What an estimate says beside its numbers: the measurement moments and modelling choices a reader should know
(pure Python, prose only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from backend.analytic.expert_layout import ExpertLayout
from backend.analytic.layout import Layout
from backend.analytic.memory.fsdp_state import peak_inside_forward
from backend.analytic.memory.stack_states import stack_memory_note
from backend.spec.choices import FOLDED_EXPERT_STACKS, Bias, Precision, Stack
from backend.spec.stack_rules import repertoire_notes

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec

SHARDLAB_COMPILED_NOTE = ("torch.compile on stack shardlab: a block that recomputes nothing, or only its attention "
                          "core (selective), keeps what Inductor saves (memory/compiled_block.py, measured on CPU "
                          "ranks, under autocast too); checkpointed blocks' re-runs, TP, MoE, MLA, windowed or math "
                          "attention keep the eager terms, an upper bound; a run's memory-tracked step runs the "
                          "blocks eagerly and is compared with the eager twin (strategies/compiled.py)")
SHARDLAB_COMPILED_LOSS_NOTE = ("compiled loss on stack shardlab: the cross-entropy keeps the 16-bit logits and two "
                               "fp32 values per row, no fp32 copy or log-probs, and its backward writes a 16-bit "
                               "gradient (memory/activations.py FUSED_LOSS_ROW_BYTES); a run's memory-tracked step "
                               "runs it eagerly and is compared with the eager twin")

GROUPED_EXPERTS_NOTE = ("grouped GEMM experts (moe_grouped_gemm): they keep no 16-bit weight copy under autocast, and "
                        "the activation peak counts the weights their forward stacks for one grouped matmul "
                        "(memory/expert_casts.py); what their backward stacks, the experts' weights and weight "
                        "gradients as (G, out, in) tensors (models/grouped_experts.GroupedLinear), is not modelled: "
                        "the engine's peak measured up to 1.0% above the prediction (ddp at world 1, fp32 and "
                        "bf16-mixed, none / full / op) and up to 3.4% under pp 2 (bf16-mixed, interleaved 1F1B; the "
                        "per-expert loop: 2.0%), on a 4-block, d_model 64 model with 8 experts of ffn 128, whose "
                        "experts' weights outweigh its activations")


def estimate_notes(spec: ExperimentSpec) -> list[str]:
    p, t, notes = spec.parallel, spec.train, []
    where = peak_inside_forward(spec)  # None under pipelining
    layout = Layout.of(spec)
    stack = layout.stack
    if stack is not None:
        notes.append(stack_memory_note(stack))
        notes.extend(repertoire_notes(spec))
    else:
        if str(t.elementwise or "eager") == "compiled":
            notes.append(SHARDLAB_COMPILED_NOTE)
        if layout.loss_compiled:
            notes.append(SHARDLAB_COMPILED_LOSS_NOTE)
    if stack is None and t.precision != Precision.FP32:
        notes.append("torch keeps fp32 params/grads/optimizer states under mixed precision (4+4+8 = 16 B/param for "
                     "AdamW); ZeRO's textbook K=12 accounting (2+2+12) is in zero_textbook")
    if p.zero_stage >= 2:
        notes.append("FSDP2 params at the end of forward: sharded "
                     f"storage{' + every unit unsharded (zero2)' if p.zero_stage == 2 else ''}; all_gather / "
                     "reduce_scatter payloads include dim-0 padding to a multiple of dp")
    if p.tp > 1:
        notes.append("TP comm: 4 (b, s, h) collectives per layer and microbatch (an SP MoE block: 2 all-gathers, no "
                     "reduce-scatter) + embedding / lm_head collectives (full logits all-gathered) + SP LayerNorm "
                     "gradient all-reduces")
    if p.pp > 1 and p.zero_stage >= 2:
        notes.append("PP x FSDP: all-gathers per unit and step = sharded->unsharded transitions (zero3 1 + "
                     "microbatches, zero2 1); unsharded gradients accumulate until the last backward (torch "
                     "pipelining/stage.py backward_maybe_with_nosync: no sync, no reshard after each backward). The "
                     "FSDP2 state at the activation peak follows the schedule's action order (fsdp_state.py): a "
                     "non-last stage peaks inside the last block of its last forward at the largest in-flight count "
                     "(zero3: the stage root and that block unsharded, + its all-gather output when that forward "
                     "gathered); under 1F1B with more microbatches than the warm-up that forward follows backwards, so "
                     "the stage's unsharded gradients are held too (sharded + dp x sharded gradient bytes); where "
                     "several moments tie (few microbatches) the tracker may keep an earlier one"
                     + ("; and a rank may still hold the all-gather output of the unit it unsharded last (gloo "
                        "frees it asynchronously; seen: the embedding root on the first stage of an interleaved "
                        "schedule, + 4 B x its numel)" if p.zero_stage == 3 else ""))
    if p.zero_stage >= 2 and where == "root":
        notes.append("FSDP x TP (fp32): lm_head's logits all-gather and the loss hold the same activation bytes (to a "
                     "few bytes); the peak is predicted inside the root's forward (the last block's all-gather buffer "
                     "alive; zero3: the root unsharded), a rank whose tracker keeps the loss moment measures neither")
    if p.ep > 1:
        notes.append("EP all_to_all and MoE activations are predicted for uniform routing (incl. the 8·E-byte count "
                     "exchange); each rank's result also carries the prediction for the routing it measured "
                     "(predicted_given_routing)")
    if p.ep > 1 and str(spec.model.moe_dispatcher) != "alltoall":
        notes.append(_dispatcher_note(spec))
    if p.ep > 1 and p.etp > 1:
        notes.append(f"etp={p.etp}: each rank holds its {spec.model.n_experts // p.ep} experts split over etp "
                     f"(weights, grads, optimizer state and GEMM FLOPs / {p.etp}; {_edp_words(spec)}); "
                     + _etp_comm_words(spec) + "; each local expert's (rows, ffn) activations are split over etp too")
    if p.ep > 1 and p.dp_cp % p.ep:
        notes.append(f"ep={p.ep} spans tp: Megatron-Core's MoE parallel folding lays the experts out as etp({p.etp}) x "
                     f"ep({p.ep}) x edp over the tp x cp x dp = {p.tp} x {p.cp} x {p.dp} ranks of a stage "
                     f"({_edp_words(spec)}); each tp rank dispatches its own sequence-parallel tokens, and the expert "
                     "gradients reduce over all edp ranks")
    if p.cp > 1:
        notes.append(cp_note(spec))
    if str(t.recompute) == "op":
        why = op_policy_note(spec)
        if why:
            notes.append(why)
    if stack is None and spec.model.is_moe and spec.model.moe_grouped_gemm:
        notes.append(GROUPED_EXPERTS_NOTE)
    if Layout.of(spec).uses_replicate and p.tp > 1 and spec.train.microbatches > 1:
        notes.append("DDP x TP: every microbatch's forward reaches the same activation bytes (to a few bytes); the "
                     "peak is predicted at the last one, after earlier no-sync backwards accumulated unsharded "
                     "gradients; a rank whose tracker keeps the first one measures only the persistent gradients")
    if p.zero_stage >= 2 and p.ep > 1 and spec.model.is_moe and p.pp == 1 and where is None:
        notes.append("FSDP x EP: what the head and loss add after the blocks outweighs the last MoE block's dispatch "
                     "buffers (activations.ep_peaks_in_last_block), so the peak is predicted at the loss, after the "
                     "root's forward (zero3: no unsharded parameter held)")
    elif p.zero_stage >= 2 and where == "block" and p.ep == 1:
        notes.append("FSDP x grouped GEMM experts: the peak is predicted inside the last MoE block's forward, at its "
                     "down projection's stacked expert weights (memory/expert_casts.py), not at the loss: the root and "
                     "that block unsharded (zero3) and its all-gather buffer alive")
    elif p.zero_stage >= 2 and where == "block":
        notes.append("FSDP x EP: the peak is predicted inside the last MoE block (its dispatch buffers): the root "
                     "and that block unsharded (zero3) and its all-gather buffer alive; a rank whose routed tokens "
                     "are fewer peaks at the loss instead and measures only the sharded storage")
    return notes


def op_policy_note(spec: ExperimentSpec) -> str | None:
    """Why `recompute op` keeps exactly what `full` keeps, when it does (None otherwise): its policy saves the outputs
    of the listed ops (torchtitan b39377f9f, torchtitan/distributed/activation_checkpoint.py `_apply_op_sac`, the list
    in torchtitan/models/llama3/infra/parallelize.py `_op_sac_save_list`): aten.mm (every second one), the SDPA kernels
    (flash / efficient / cudnn; `_scaled_dot_product_attention_math` is a CompositeImplicitAutograd op, decomposed
    before the policy's dispatch mode sees it), reduce-scatter, max. This model's math attention runs matmul /
    softmax (aten.bmm), and a Linear with a bias runs aten.addmm, neither listed."""
    from backend.analytic.memory.activations import LayerShape, op_sac_saved_bytes

    shape = LayerShape.of_spec(spec)
    if op_sac_saved_bytes(shape):
        return None
    linears = "every block Linear has a bias (aten.addmm)" if spec.model.bias == Bias.ALL else \
        "its Linears without a bias run aten.mm, but none is saved here"
    return (f"recompute op = full here, to the byte: op-level SAC saves the outputs of {', '.join(spec.train.sac_ops)} "
            f"(every second aten.mm), and this model saves none of them: {linears} and math attention runs "
            "matmul / softmax (aten.bmm), while torchtitan's Llama has no Linear bias and its SDPA attention (flash, "
            "efficient, cudnn) is saved; math SDPA decomposes before the policy sees it (torchtitan "
            "torchtitan/distributed/activation_checkpoint.py `_apply_op_sac` at b39377f9f). To keep more, list "
            "aten.addmm.default / aten.bmm.default in recompute_ops or use flash attention")


def cp_note(spec: ExperimentSpec) -> str:
    """What context parallelism divides and what it does not, with the ring's transient buffers in bytes."""
    from backend.analytic.layout import Layout
    from backend.analytic.traffic import cp_ring_bytes

    p, layout = spec.parallel, Layout.of(spec)
    kv, dkv = cp_ring_bytes(spec.model, layout)
    held = p.cp * kv if str(p.cp_rotate) == "allgather" else 2 * kv
    states = ("sharded over dp x cp" if p.zero_stage >= 2 else "ZeRO-1 optimizer state sharded over dp x cp"
              if p.zero_stage == 1 else "not divided (replicated on the dp x cp ranks)")
    te = layout.te_ring
    ring = ("Transformer Engine's ring (K/V at the GQA width, dK/dV in the compute dtype; Megatron's default "
            "--cp-comm-type p2p is cp_rotate alltoall)" if te else "torch's ring (K/V repeated to the query heads, "
            "fp32 dK/dV accumulators)")
    return (f"CP: every per-token activation is at seq_len / cp = {spec.model.seq_len // p.cp} tokens per rank (the "
            f"blocks, the logits, RoPE tables, positions, the batch copy); ring attention saves what flash saves. Not "
            f"divided by cp: parameters / gradients / optimizer state are {states}; {ring}: its K/V buffers live only "
            f"inside an attention call ({held:,.0f} B of K/V in flight in forward ({p.cp_rotate}), + {2 * dkv:,.0f} B "
            "of dK/dV in backward, per layer), not at the forward activation peak (a backward "
            f"moment can top it by up to those dK/dV bytes); K/V traffic per layer "
            f"and microbatch: traffic.cp_traffic")


def _edp_words(spec: ExperimentSpec) -> str:
    """The expert data-parallel degree and its arithmetic on this spec's expert grid (expert_layout.py)."""
    p = spec.parallel
    edp = ExpertLayout.of_spec(spec).edp
    if spec.train.stack in FOLDED_EXPERT_STACKS:
        return f"edp = tp x cp x dp / (etp x ep) = {p.tp * p.dp_cp} / {p.etp * p.ep} = {edp}"
    return f"edp = dp x cp / ep = {p.dp_cp} / {p.ep} = {edp}"


def _dispatcher_note(spec: ExperimentSpec) -> str:
    """What the step time counts of the allgather or flex dispatcher, and what the prediction leaves out."""
    p = spec.parallel
    group = f"the tp x ep group (etp x ep = {p.etp} x {p.ep} = {p.etp * p.ep} ranks)"
    if str(spec.model.moe_dispatcher) == "allgather":
        return (f"moe_dispatcher=allgather: every MoE block all-gathers the hidden states of {group} and "
                "reduce-scatters the experts' output back, forward and backward (steptime/ep_comm.py); its gather "
                "buffer (Megatron's global mpu buffer) is held at every moment (other_bytes); the gathered routing map "
                "and probs are not counted, and the activations are the all-to-all dispatcher's")
    return (f"moe_dispatcher=flex (DeepEP / HybridEP) over {group}: the step time counts a token once per rank that "
            "holds one of its experts and once per such node across nodes (uniform routing, ep_dispatch.flex_rows), "
            "each link at the hardware table's bandwidth; comm_bytes counts the rows before that deduplication; the "
            "kernels' SMs and their NVLink / RDMA buffers are not counted (the activations are the all-to-all "
            "dispatcher's)")


def _etp_comm_words(spec: ExperimentSpec) -> str:
    """How expert TP communicates on this spec's stack (ep_dispatch.py)."""
    if spec.train.stack == Stack.MEGATRON:
        return ("Megatron's dispatcher all-gathers the all-to-all's output over etp before the experts and "
                "reduce-scatters their output after them (token_dispatcher.py)")
    return "the MoE input is whole on every tp rank, so the all-to-all is that of etp 1 and the experts' all-reduces " \
           "run over etp"
