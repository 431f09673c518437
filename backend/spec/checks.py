"""Cross-field checks of an ExperimentSpec, run by its model validator: derive unset degrees and batch sizes,
then list every problem with its arithmetic ("tp=3 does not divide n_heads=8 (8 % 3 = 2)").

Derivation writes the derived values into the (still validating) sections; a spec either comes out
complete and runnable or raises `SpecError` with all problems at once.
"""

from __future__ import annotations

import math
import re

from backend.spec import dims
from backend.spec.choices import (
    FOLDED_EXPERT_STACKS,
    MULTI_STAGE_SCHEDULES,
    V_SHAPE_SCHEDULES,
    Schedule,
    Strategy,
    expert_grid_fits,
)
from backend.spec.framework_support import check_framework
from backend.spec.model_spec import ModelSpec
from backend.spec.parallel_spec import ParallelSpec
from backend.spec.run_rules import blocking_reasons
from backend.spec.spec_parts import SpecParts
from backend.spec.stack_rules import stack_problems
from backend.spec.train_spec import TrainSpec

_ENDPOINT = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252})|\[[0-9A-Fa-f:.]+\]):"
                       r"(?:6553[0-5]|655[0-2]\d|65[0-4]\d\d|6[0-4]\d{3}|[1-5]\d{4}|[1-9]\d{0,3})")


class RunOnly(str):
    """A problem that stops a spec from RUNNING here but not from being predicted (ExperimentSpec.for_prediction)."""


def derive_and_check(s: SpecParts) -> list[str]:
    m, t, p, r = s.model, s.train, s.parallel, s.runtime
    problems: list[str] = []
    problems += _check_model(m)
    problems += _derive_degrees(p)
    if problems:
        return problems
    problems += _check_degrees(m, p, folds_over_tp=t.stack in FOLDED_EXPERT_STACKS)
    problems += _derive_batch(t, p)
    problems += _check_pipeline(m, t, p)
    problems += stack_problems(s)
    problems += [RunOnly(reason) for reason in blocking_reasons(s)]
    if t.recompute_ops is not None and t.recompute != "op":
        problems.append(f"recompute_ops lists the ops `op` recompute saves; recompute is {t.recompute!r}, not 'op'")
    if r.node_rank >= r.nnodes:
        problems.append(f"node_rank={r.node_rank} must be < nnodes={r.nnodes}")
    if r.nnodes > 1 and not r.rdzv_endpoint and r.executor != "slurm":  # on SLURM the allocation gives it
        problems.append(f"nnodes={r.nnodes} needs rdzv_endpoint host:port for the c10d rendezvous")
    if r.rdzv_endpoint and not _ENDPOINT.fullmatch(r.rdzv_endpoint):
        problems.append(f"rdzv_endpoint={r.rdzv_endpoint!r} is not host:port (host: letters, digits, '.', '-' or "
                        "[IPv6]; port 1-65535)")
    if r.nnodes > 1 and p.world_size % r.nnodes:
        problems.append(f"world_size={p.world_size} is not divisible by nnodes={r.nnodes}")
    problems += _check_backend_device(s)
    problems += check_framework(s)  # each framework declares what it runs
    return problems


def _check_backend_device(s: SpecParts) -> list[str]:
    """gloo has no CUDA reduce_scatter / all_to_all (FSDP2, ZeRO-2/3, EP and SP need them); nccl has no CPU tensors."""
    r = s.runtime
    if str(r.backend) == "gloo" and str(r.device) == "cuda":
        return ["backend=gloo with device=cuda: gloo implements neither reduce_scatter nor all_to_all on CUDA tensors "
                "(FSDP2, EP and sequence parallel need them); use backend=nccl (or auto) for cuda, gloo for cpu"]
    if str(r.backend) == "nccl" and str(r.device) == "cpu":
        return ["backend=nccl with device=cpu: NCCL only reduces CUDA tensors; use device=cuda (or auto) with nccl"]
    return []


def _check_model(m: ModelSpec) -> list[str]:
    out = []
    if m.d_model % m.n_heads and m.attn_head_dim is None and not m.is_mla:
        out.append(f"n_heads={m.n_heads} does not divide d_model={m.d_model} ({m.d_model} % {m.n_heads} = "
                   f"{m.d_model % m.n_heads}); set attn_head_dim for heads of their own width")
    if m.kv_heads > m.n_heads or m.n_heads % m.kv_heads:
        out.append(f"n_kv_heads={m.kv_heads} must divide n_heads={m.n_heads} (GQA groups query heads evenly)")
    if m.is_moe and m.top_k > m.n_experts:
        out.append(f"top_k={m.top_k} exceeds n_experts={m.n_experts}")
    out += _check_family(m)
    return out


def _check_family(m: ModelSpec) -> list[str]:
    """The architecture-family fields (norm, mlp, positions, bias, shared experts) against each other."""
    out = []
    moe_only = {"n_shared_experts": m.n_shared_experts or None, "expert_ffn_hidden": m.expert_ffn_hidden,
                "shared_expert_gate": m.shared_expert_gate or None}
    for name, value in moe_only.items():
        if value is not None and not m.is_moe:
            out.append(f"{name}={value} needs a MoE model (n_experts > 0, got n_experts=0)")
    if m.shared_ffn_hidden is not None and not m.n_shared_experts:
        out.append(f"shared_ffn_hidden={m.shared_ffn_hidden} needs n_shared_experts >= 1 (got 0)")
    if m.shared_expert_gate and not m.n_shared_experts:
        out.append("shared_expert_gate needs n_shared_experts >= 1 (got 0)")
    if (m.positions == "rope" and not m.is_mla and m.attn_head_dim is None and m.d_model % m.n_heads == 0
            and m.head_dim % 2):
        out.append(f"rope rotates pairs of channels: head_dim = d_model / n_heads = {m.d_model} / {m.n_heads} = "
                   f"{m.head_dim} must be even")
    if m.positions == "rope" and m.attn_head_dim is not None and m.attn_head_dim % 2:
        out.append(f"rope rotates pairs of channels: attn_head_dim={m.attn_head_dim} must be even")
    out += _check_mla(m) + _check_routing(m) + _check_window(m)
    return out


def _check_mla(m: ModelSpec) -> list[str]:
    """Multi-head latent attention (DeepSeek-V2 Sec 2.1): latent width, decoupled rope width, value width."""
    mla = {"q_lora_rank": m.q_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim or None,
           "qk_rope_head_dim": m.qk_rope_head_dim or None, "v_head_dim": m.v_head_dim or None}
    if not m.is_mla:
        return [f"{k}={v} needs MLA (kv_lora_rank set, got None)" for k, v in mla.items() if v is not None]
    out = [f"MLA needs {k} >= 1 (got 0)" for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if not mla[k]]
    if m.qk_rope_head_dim % 2:
        out.append(f"rope rotates pairs of channels: qk_rope_head_dim={m.qk_rope_head_dim} must be even")
    if m.positions != "rope":
        out.append(f"MLA's decoupled key is rotary: positions must be rope (got {m.positions})")
    if m.n_kv_heads not in (None, m.n_heads):
        out.append(f"MLA expands the latent into every head's key and value: n_kv_heads={m.n_kv_heads} must be "
                   f"None or n_heads={m.n_heads}")
    if m.attn_head_dim is not None:
        out.append(f"attn_head_dim={m.attn_head_dim} does not apply to MLA (qk_nope_head_dim + qk_rope_head_dim and "
                   "v_head_dim give the widths)")
    if m.qk_norm or m.attention_sinks:
        out.append("qk_norm / attention_sinks are not modelled together with MLA")
    return out


def _check_routing(m: ModelSpec) -> list[str]:
    """The MoE routing fields (dense prefix, interleave, scores, groups) against the expert count."""
    routing = {"first_dense_layers": m.first_dense_layers or None,
               "moe_every": None if m.moe_every == 1 else m.moe_every,
               "router_score": None if m.router_score == "softmax" else m.router_score,
               "router_bias": m.router_bias or None, "router_balance_bias": m.router_balance_bias or None,
               "expert_groups": None if m.expert_groups == 1 else m.expert_groups,
               "topk_groups": None if m.topk_groups == 1 else m.topk_groups, "capacity_factor": m.capacity_factor,
               "moe_pad_to_capacity": m.moe_pad_to_capacity or None, "moe_aux_loss_coeff": m.moe_aux_loss_coeff or None,
               "moe_dispatcher": None if m.moe_dispatcher == "alltoall" else m.moe_dispatcher,
               "moe_grouped_gemm": m.moe_grouped_gemm or None,
               "moe_imbalance": None if m.moe_imbalance == 1.0 else m.moe_imbalance}
    if not m.is_moe:
        return [f"{k}={v} needs a MoE model (n_experts > 0, got n_experts=0)" for k, v in routing.items()
                if v is not None]
    out = []
    if m.moe_pad_to_capacity and m.capacity_factor is None:
        # Megatron-Core transformer_config.py @ core_v0.19.0 l. 1686-1690 refuses the same
        out.append("moe_pad_to_capacity pads every expert's input to its capacity: it needs capacity_factor "
                   "(got None = dropless)")
    if not any(m.layer_is_moe(i) for i in range(m.n_layers)):
        out.append(f"no MoE block: first_dense_layers={m.first_dense_layers}, moe_every={m.moe_every} leave all "
                   f"n_layers={m.n_layers} blocks dense")
    if m.n_experts % m.expert_groups:
        out.append(f"expert_groups={m.expert_groups} does not divide n_experts={m.n_experts} "
                   f"({m.n_experts} % {m.expert_groups} = {m.n_experts % m.expert_groups})")
    elif m.topk_groups > m.expert_groups:
        out.append(f"topk_groups={m.topk_groups} exceeds expert_groups={m.expert_groups}")
    elif m.expert_groups > 1 and m.top_k > m.topk_groups * (m.n_experts // m.expert_groups):
        out.append(f"top_k={m.top_k} exceeds the experts of topk_groups groups: {m.topk_groups} * "
                   f"({m.n_experts} / {m.expert_groups}) = {m.topk_groups * (m.n_experts // m.expert_groups)}")
    return out


def _check_window(m: ModelSpec) -> list[str]:
    if m.window is None:
        return [f"{k} needs a window (window=None)" for k, v in (("global_every", m.global_every),
                ("global_layers_nope", m.global_layers_nope), ("window_kind=chunked", m.window_kind == "chunked")) if v]
    if m.global_layers_nope and not m.global_every:
        return ["global_layers_nope needs global layers (global_every >= 1, got 0)"]
    return []


def _derive_degrees(p: ParallelSpec) -> list[str]:
    st = p.strategy
    if st in dims.pure_strategies(dims.DIMS) and getattr(p, st) == 1 and p.world_size:
        # `--strategy tp --world 4` means tp = 4: the pure strategy's degree is the whole world.
        setattr(p, st, p.world_size)
    # world = dp x the other in-world degrees (tp, pp, cp), each named in the arithmetic (cp only when > 1)
    others = [d for d in dims.DIMS if d.in_world and not d.remainder]
    model_parallel = math.prod(getattr(p, d.name) for d in others)
    named = " * ".join(f"{d.name}({getattr(p, d.name)})" for d in others if d.always_named or getattr(p, d.name) > 1)
    if p.dp is None:
        if p.world_size is None:
            p.dp = p.ep if st == Strategy.EP else 1
        elif p.world_size % model_parallel:
            return [f"world_size({p.world_size}) is not divisible by {named} = {model_parallel}"]
        else:
            p.dp = p.world_size // model_parallel
    if p.world_size is None:
        p.world_size = p.dp * model_parallel
    if p.dp * model_parallel != p.world_size:
        return [f"dp({p.dp}) * {named} = {p.dp * model_parallel} != world_size({p.world_size})"]
    return []


def _check_degrees(m: ModelSpec, p: ParallelSpec, folds_over_tp: bool = False) -> list[str]:
    """folds_over_tp: the stack lays the experts out on their own grid (Megatron-Core's MoE parallel folding), so ep
    may span the tp ranks (analytic/expert_layout.py)."""
    out = []
    for name in dims.pure_strategies(dims.DIMS):
        if p.strategy == name and getattr(p, name) < 2:
            out.append(f"strategy {name} needs {name} >= 2 (got {name}={getattr(p, name)}, world_size={p.world_size})")
    if p.tp > 1:
        if m.n_heads % p.tp:
            out.append(f"tp={p.tp} does not divide n_heads={m.n_heads}")
        if m.kv_heads % p.tp:
            out.append(f"tp={p.tp} does not divide n_kv_heads={m.kv_heads}")
        if m.ffn % p.tp:
            out.append(f"tp={p.tp} does not divide ffn_hidden={m.ffn}")
        if m.is_moe and p.ep == 1 and m.expert_ffn % p.tp:  # ep > 1: whole experts on every tp rank (etp = 1)
            out.append(f"tp={p.tp} does not divide expert_ffn_hidden={m.expert_ffn} ({m.expert_ffn} % {p.tp} = "
                       f"{m.expert_ffn % p.tp})")
        if m.shared_ffn % p.tp:
            out.append(f"tp={p.tp} does not divide the shared-expert hidden n_shared_experts * shared_ffn_hidden = "
                       f"{m.shared_ffn} ({m.shared_ffn} % {p.tp} = {m.shared_ffn % p.tp})")
    if p.sequence_parallel and p.tp < 2:
        out.append(f"sequence_parallel needs tp >= 2 (got tp={p.tp})")
    if p.ep > 1:
        if not m.is_moe:
            out.append(f"ep={p.ep} needs a MoE model (n_experts > 0, got n_experts=0)")
        elif m.n_experts % p.ep:
            out.append(f"ep={p.ep} does not divide n_experts={m.n_experts} ({m.n_experts} % {p.ep} = "
                       f"{m.n_experts % p.ep})")
        spans_tp = folds_over_tp and p.etp < p.tp  # the tp ranks route their own tokens: ep may reach into them
        fits = expert_grid_fits(p.tp, p.dp_cp, p.ep, p.etp, folds_over_tp)
        if spans_tp and not fits:
            out.append(f"etp({p.etp}) * ep({p.ep}) = {p.etp * p.ep} does not divide tp * cp * dp = {p.tp} * {p.cp} * "
                       f"{p.dp} = {p.tp * p.dp_cp} (Megatron-Core's expert layout etp x ep x edp covers a stage's "
                       "ranks: world % (etp x ep x pp) == 0, parallel_state.initialize_model_parallel @ core_v0.19.0)")
        elif not fits:
            group = f"dp * cp = {p.dp} * {p.cp} = {p.dp_cp}" if p.cp > 1 else f"dp={p.dp}"
            out.append(f"ep={p.ep} does not divide {group} (expert-parallel ranks are carved out of the data-parallel "
                       f"ranks){_fold_note(p)}")
    out += _check_expert_tp(m, p)
    out += _check_context_parallel(m, p)
    return out


def _fold_note(p: ParallelSpec) -> str:
    """Where ep does not fit in dp x cp: Megatron-Core's folding would place it over the tp ranks too; say so."""
    ranks = p.tp * p.dp_cp
    if p.tp == 1 or ranks % (p.etp * p.ep):
        return ""
    return (f"; Megatron-Core's MoE parallel folding would lay the experts out as etp({p.etp}) x ep({p.ep}) x "
            f"edp({ranks // (p.etp * p.ep)}) over the tp({p.tp}) x cp({p.cp}) x dp({p.dp}) = {ranks} ranks of a stage "
            "(ep spanning tp, each tp rank routing its own sequence-parallel tokens: parallel_state."
            "initialize_model_parallel @ core_v0.19.0, expert RankGenerator order tp-ep-dp-pp); this stack carves ep "
            "out of dp x cp and the tp / etp ranks of a group hold the same experts: set stack megatron (and etp < tp) "
            "to predict the folded layout")


def _check_expert_tp(m: ModelSpec, p: ParallelSpec) -> list[str]:
    """The expert layout etp x ep x edp over a stage's tp x cp x dp ranks (analytic/expert_layout.py): etp splits each
    expert over ranks of the tp group (etp | tp, torchtitan's ExpertTensorParallel at etp = tp; Megatron-Core allows
    any etp with world % (etp x ep x pp) == 0, parallel_state.py @ core_v0.19.0 l. 871-897), ep is carved out of
    dp x cp, edp = dp x cp / ep, and tp / etp ranks hold the same expert shards."""
    if p.etp == 1:
        return []
    if not m.is_moe:
        return [f"etp={p.etp} needs a MoE model (n_experts > 0, got n_experts=0)"]
    if p.ep == 1:
        if p.etp == p.tp:
            return []
        return [f"etp={p.etp} with ep=1: without expert parallelism the routed experts are split over tp like the "
                f"dense MLP (etp = tp = {p.tp}, Megatron's default); set ep > 1 for another expert tensor-parallel "
                "degree"]
    out = []
    if p.tp % p.etp:
        out.append(f"etp={p.etp} does not divide tp={p.tp} ({p.tp} % {p.etp} = {p.tp % p.etp}): each expert is split "
                   f"over etp ranks of the tp group, so the expert layout etp x ep x edp = {p.etp} x {p.ep} x edp must "
                   f"fold into tp x cp x dp = {p.tp} x {p.cp} x {p.dp} with etp | tp (torchtitan: etp in {{1, tp}})")
    if m.expert_ffn % p.etp:
        out.append(f"etp={p.etp} does not divide expert_ffn_hidden={m.expert_ffn} "
                   f"({m.expert_ffn} % {p.etp} = {m.expert_ffn % p.etp})")
    return out


def _check_context_parallel(m: ModelSpec, p: ParallelSpec) -> list[str]:
    """cp splits every sequence into equal chunks (2cp head-tail chunks when load-balanced) and runs ring attention,
    which merges per-chunk flash outputs by their logsumexp: torch's context_parallel dispatches only the fused SDPA
    kernels, and the s x s scores of math attention are never formed."""
    if p.cp == 1:
        return []
    out = []
    if m.attention != "flash":
        out.append(f"cp={p.cp} needs attention=flash (got {m.attention}): ring attention merges per-chunk flash "
                   "outputs by their logsumexp, as torch's context_parallel does over the fused SDPA kernels")
    chunks = 2 * p.cp if p.cp_load_balance else p.cp
    if m.seq_len % chunks:
        how = f"2 * cp = {chunks} head-tail chunks" if p.cp_load_balance else f"cp = {chunks} chunks"
        out.append(f"seq_len={m.seq_len} does not split into {how} ({m.seq_len} % {chunks} = {m.seq_len % chunks})")
    return out


def run_blockers(spec: SpecParts) -> list[str]:
    """Why this engine cannot RUN a spec that it can predict (`ExperimentSpec.for_prediction`), [] when it can: the
    rules of backend/spec/run_rules.py, which the planner applies to its arrays of layouts too. `estimate`, the
    New-experiment prediction and `plan` go on; `run`, `submit` and the Run button refuse. This host's capacity is a
    separate check (backend/launch/capacity.py)."""
    return blocking_reasons(spec)


def _derive_batch(t: TrainSpec, p: ParallelSpec) -> list[str]:
    per_step = t.micro_batch * p.dp
    if t.microbatches is not None and "global_batch" not in t.model_fields_set:
        # only the microbatch count was given: it fixes the global batch (the default 8 must not veto it)
        t.global_batch = t.microbatches * per_step
    if t.global_batch % per_step:
        return [f"global batch {t.global_batch} is not divisible by micro-batch {t.micro_batch} * dp {p.dp} = "
                f"{per_step}"]
    derived = t.global_batch // per_step
    if t.microbatches is None:
        t.microbatches = derived
    elif t.microbatches != derived:
        return [
            f"microbatches={t.microbatches} != global batch {t.global_batch} / (micro-batch {t.micro_batch} * dp "
            f"{p.dp}) = {derived}"
        ]
    return []


def _check_pipeline(m: ModelSpec, t: TrainSpec, p: ParallelSpec) -> list[str]:
    out = []
    multi = p.pp_schedule in MULTI_STAGE_SCHEDULES
    if p.pp == 1:
        if p.virtual_stages > 1:
            out.append(f"virtual_stages={p.virtual_stages} needs pp > 1")
        return out
    if multi and p.virtual_stages < 2:
        out.append(f"{p.pp_schedule} needs virtual_stages >= 2 (got {p.virtual_stages})")
    if not multi and p.virtual_stages > 1:
        out.append(f"{p.pp_schedule} runs one stage per rank: virtual_stages must be 1 (got {p.virtual_stages})")
    if p.pp_schedule in V_SHAPE_SCHEDULES and p.virtual_stages != 2:
        out.append(f"{p.pp_schedule} runs exactly 2 stages per rank (got virtual_stages={p.virtual_stages})")
    stages = p.pp * p.virtual_stages
    if m.n_layers < stages:
        out.append(f"n_layers={m.n_layers} < pp({p.pp}) * virtual_stages({p.virtual_stages}) = {stages} stages: every "
                   "stage needs a layer")
    mb = t.microbatches or 0
    if p.pp_schedule != Schedule.GPIPE and mb < p.pp:
        out.append(f"{p.pp_schedule.upper()} needs microbatches >= pp (got microbatches={mb}, pp={p.pp})")
    if p.pp_schedule == Schedule.DUALPIPEV and mb < stages:
        # torch 2.13 ScheduleDualPipeV.__init__ (schedules.py l. 3439) raises the same
        out.append(f"dualpipev needs microbatches >= pp * virtual_stages = {p.pp} * {p.virtual_stages} = {stages} "
                   f"stages (got microbatches={mb})")
    if multi and p.pp_schedule != Schedule.DUALPIPEV and mb % p.pp:
        out.append(f"{p.pp_schedule} needs microbatches divisible by pp (got {mb} % {p.pp} = {mb % p.pp})")
    return out
