"""Predicted step time per rank with a breakdown, and the slowest rank's summary (pure Python).

step = pipeline makespan (microbatch passes incl. exposed TP / EP collectives, bubble, p2p)
       + exposed data-parallel sync + optimizer step + fixed overhead.
Per microbatch: compute (compute.py) + TP collectives, all exposed (Megatron's f/g all-reduces sit on the
critical path, Shoeybi 2019 Sec 3; Narayanan 2021 Sec 3.2) + EP all-to-alls, exposed (GShard Sec 3.1) + CP's ring
K/V transfers where the attention blocks do not hide them (cp_ring.py).
Data parallel: DDP's bucketed all-reduce overlaps the last microbatch's backward, the last bucket cannot
(Li et al. 2020, "PyTorch Distributed", VLDB, Sec 3.2.3; 25 MB buckets); FSDP2 all-gathers are
prefetched behind forward/backward and reduce-scatters run behind backward, except the first gather and
the last reduce-scatter (Zhao et al. 2023, "PyTorch FSDP", VLDB, Sec 3.3); ZeRO-1's parameter broadcast
follows the optimizer step, exposed. More ranks than cores (CPU profile) time-share them. Host DTensor dispatch
(host.py: TP layers, optimizer over DTensor parameters) adds where the host runs the kernels (CPU; 0 on GPUs).
MFU = model FLOPs (6N + 12·L·s·h per token, no recompute; PaLM, Chowdhery 2022 App. B) / (step · n · peak);
tflops_per_gpu counts the FLOPs actually executed incl. recompute (Narayanan 2021 Eq. 3 convention).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from backend.analytic.ep_dispatch import all_to_all_payload_bytes, dispatch_group
from backend.analytic.layout import Layout
from backend.analytic.model_flops import training_flops_per_step
from backend.analytic.recompute_cost import flops_rerun, rerun_share_of
from backend.analytic.sharding import LocalParam, derived, local_params_shared, rank_stages, stage_layers
from backend.analytic.steptime.collectives import (
    INTER,
    INTRA,
    all_to_all_s,
    collective_s,
    dim_tier,
    members_per_node,
    ring_steps,
    within_node,
)
from backend.analytic.steptime.compute import ATTENTION, IMPLEMENTATIONS, PassCost, attention_pass, memory_s, stage_cost
from backend.analytic.steptime.cp_ring import RingTime, ring_time
from backend.analytic.steptime.dp_sync import dp_exposed, fsdp_host_s
from backend.analytic.steptime.ep_comm import dispatcher_bandwidth_s
from backend.analytic.steptime.ep_overlap import hidden_ep_s, steady_fraction
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.steptime.host import optimizer_dispatch, tp_dispatch_layers
from backend.analytic.steptime.ops import OPTIMIZER_IMPL, optimizer_time
from backend.analytic.steptime.schedule import SIMULATED, makespan, makespan_pair
from backend.analytic.steptime.stack_knobs import StackKnobs, stack_knobs
from backend.analytic.steptime.torchao_rowwise import ROWWISE_GEMMS
from backend.analytic.steptime.tp_overlap import HiddenTp, hidden_tp
from backend.analytic.steptime.untimed import NotTimed, untimed_reason
from backend.analytic.textbook.pipeline import bubble_over_ideal
from backend.analytic.traffic import compute_bytes, ep_rows, ep_traffic, tp_traffic

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec

UNCALIBRATED_BAND = 0.2
"""Relative half-width of low_s/high_s without a calibration (no fit, so no residuals to draw on)."""
STEP_KEYS = ("step_s", "low_s", "high_s", "compute_s", "exposed_comm_s", "bubble_s", "optimizer_s", "other_s",
             "tokens_per_s", "tflops_per_gpu", "mfu")


@dataclass
class RankTime:
    rank: int
    pp_rank: int
    step_s: float
    compute_s: float
    recompute_s: float
    exposed_comm_s: float
    bubble_s: float
    optimizer_s: float
    other_s: float
    comm_s: dict[str, float] = field(default_factory=dict)
    """Collective seconds per mesh dimension before overlap (tp, ep, cp, pp, dp)."""
    exposed_by_dim_s: dict[str, float] = field(default_factory=dict)
    comm_by_collective_s: dict[str, float] = field(default_factory=dict)
    """Collective seconds per step before overlap by collective (all_reduce, all_gather, ...; pp p2p not included),
    comparable with a run's measured `comm.<collective>.seconds`."""


@dataclass
class StepTime:
    hardware: str
    per_rank: list[RankTime]
    summary: dict[str, float]
    """The slowest rank: exactly STEP_KEYS (the `step_time` JSON contract)."""
    notes: list[str] = field(default_factory=list)
    caveats: list[str] = field(default_factory=list)
    """The notes that qualify the number (stack_knobs.StackKnobs.caveats, a missing fp8 peak, an EP overlap that cannot
    apply): `estimate` and New experiment print them with the step time."""
    stage_fwd_s: list[float] = field(default_factory=list)
    """Seconds of one microbatch's forward per pipeline stage (p·v of them; with its TP / EP collectives)."""
    stage_bwd_s: list[float] = field(default_factory=list)
    """The same for backward (incl. recompute)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class InconsistentStepTime(RuntimeError):
    """The step's parts do not add up to the step for some rank: a defect of this model, never of the input. Callers
    that time many layouts (the planner) report the layout by name and go on."""


def check_parts_sum(rank: int, parts: dict[str, float], step_s: float) -> None:
    """compute + exposed comm + bubble + optimizer + other must equal the step (to 1e-6 relative) on every rank."""
    total = sum(parts.values())
    if not abs(total - step_s) < 1e-6 * max(1.0, step_s):
        terms = " + ".join(f"{k} {v:.6g}" for k, v in parts.items())
        raise InconsistentStepTime(f"rank {rank}'s step-time parts do not add up to its step: {terms} = {total:.6g} s "
                                   f"!= step {step_s:.6g} s")


def _timeshare(spec: ExperimentSpec, hw: Hardware) -> float:
    return max(1.0, spec.parallel.world_size / hw.cores) if hw.kind == "cpu" and hw.cores else 1.0


def _mp_comm(spec: ExperimentSpec, hw: Hardware, g: int, layers: list[int], stages: list[int], layout: Layout,
             kinds: dict[str, float] | None = None) -> dict[str, float]:
    """Seconds per step of this rank's TP and EP traffic (traffic.tp_traffic, ep_traffic; PP's hops are the
    schedule's: p2p_hop_s) by dimension; also summed by collective into `kinds`."""
    m = spec.train.microbatches
    out = {"tp": 0.0, "ep": 0.0}
    traffic = tp_traffic(spec, layers, stages) if spec.parallel.tp > 1 else []
    if str(spec.model.moe_dispatcher) == "alltoall":
        traffic += ep_traffic(spec, layers)
    else:
        out["ep"] = _dispatcher_s(spec, hw, g, layers, layout, kinds)
    for kind, payload, n in traffic:
        dim = "ep" if kind == "all_to_all" else "tp"
        # 4 per layer and microbatch: all-reduces, or SP's all-gathers / reduce-scatters
        calls = max(1, 4 * len(layers) * m)
        tier = dim_tier(spec, dim, n, g)
        if kind == "all_to_all":  # each peer its own rows: the node's members over NVLink, the others over the NIC
            sec = all_to_all_s(hw, tier, payload, n, members_per_node(spec, dim, n, g), calls=calls)
        else:
            sec = collective_s(hw, tier, kind, payload, n, calls=calls)
        out[dim] += sec
        if kinds is not None:
            kinds[kind] = kinds.get(kind, 0.0) + sec
    return out


def _dispatcher_s(spec: ExperimentSpec, hw: Hardware, g: int, layers: list[int], layout: Layout,
                  kinds: dict[str, float] | None) -> float:
    """The allgather or flex dispatcher's seconds per step (steptime/ep_comm.py), plus its collectives' ring latency
    at the tp x ep group's tier: 4 per layer and microbatch, as the all-to-alls count them."""
    entries = ep_traffic(spec, layers)
    if not entries:
        return 0.0
    m, t = spec.model, spec.train
    sent, row_bytes, passes = ep_rows(spec, layers)
    payload = passes * all_to_all_payload_bytes(m, sent, row_bytes)
    group, stride = dispatch_group(layout)
    tier = INTRA if within_node(stride, group, "ep", g) else INTER
    alpha = hw.tune.intra_latency_s if tier == INTRA else hw.tune.inter_latency_s
    sec = float(dispatcher_bandwidth_s(m, layout, hw, g, payload=payload, sent_tokens=sent, passes=passes))
    sec += max(1, 4 * len(layers) * t.microbatches) * ring_steps("all_to_all", group) * alpha
    if kinds is not None:
        for kind, _, _ in entries:
            kinds[kind] = kinds.get(kind, 0.0) + sec / len(entries)
    return sec


def p2p_hop_s(spec: ExperimentSpec, hw: Hardware, g: int) -> float:
    """One microbatch activation (b, s, h) crossing one stage boundary. Across nodes with tp > 1 each tp rank
    sends 1/t of it and the next stage all-gathers over NVLink (Narayanan 2021 Sec 4.1 scatter/gather)."""
    p, t, m = spec.parallel, spec.train, spec.model
    if p.pp == 1:
        return 0.0
    act = t.micro_batch * (m.seq_len // p.cp) * m.d_model * compute_bytes(t.precision)
    tier = dim_tier(spec, "pp", p.pp, g)
    if tier == INTER and p.tp > 1:
        return collective_s(hw, tier, "send", act / p.tp, 2) + collective_s(hw, INTRA, "all_gather", act, p.tp)
    return collective_s(hw, tier, "send", act, 2)


def _add_dispatch(spec: ExperimentSpec, hw: Hardware, c: PassCost, params: list, stage: int) -> None:
    """Host DTensor dispatch of one microbatch through this stage (host.py): 1/3 in forward, 2/3 in backward
    (as its GEMMs: dgrad + wgrad), and the forward's share again under full recompute."""
    host_s = hw.tune.dtensor_op_s * tp_dispatch_layers(spec, params, _layers(spec, stage))
    c.fwd_s += host_s / 3
    c.bwd_s += 2 * host_s / 3
    rc = str(spec.train.recompute)
    if rc == "full":
        c.recompute_s += host_s / 3
    elif rc not in ("none", "selective"):
        c.recompute_s += host_s / 3 * float(rerun_share_of(spec).gemm)


def _optimizer_s(spec: ExperimentSpec, hw: Hardware, params: list, implementation: str) -> float:
    """AdamW reads p, g, m, v and writes p, m, v (28 B per fp32 element; SGD 20 B), memory bound
    (Loshchilov & Hutter 2019 Alg. 2); ZeRO-1 owns 1/dp of the local elements (Rajbhandari 2020 Sec 5.1). GPUs run
    it at the implementation's measured bandwidth (ops.optimizer_time); CPU ranks run single-tensor AdamW, ~5 ops
    per tensor."""
    p, t = spec.parallel, spec.train
    real, local, _ = derived(params, "numel_sums", _numel_sums)
    if p.zero_stage >= 2:
        elems = real
    else:
        elems = local / (p.dp_cp if p.zero_stage == 1 else 1)
    per = 28 if str(t.optimizer) == "adamw" else 20
    dispatch = hw.tune.dtensor_op_s * optimizer_dispatch(spec, params)
    if hw.kind == "cpu":
        return memory_s(hw, per * elems, kernels=len(params) * 5) + dispatch
    return optimizer_time(hw, elems, OPTIMIZER_IMPL[implementation], per_element_bytes=per, kernels=1) + dispatch


def _numel_sums(params: Sequence[LocalParam]) -> tuple[int, int, int]:
    """(real, local, storage) elements of a rank's parameters."""
    return (sum(q.real_numel for q in params), sum(q.local_numel for q in params), sum(q.storage_numel for q in params))


def step_time(spec: ExperimentSpec, hw: Hardware, *, gpus_per_node: int | None = None, attention: str | None = None,
              band: tuple[float, float] | None = None, implementation: str | None = None) -> StepTime:
    """Per-rank predicted step time of a validated spec on `hw` (the slowest rank summarised in STEP_KEYS).
    The spec's stack (spec/stacks.py, resolved on the profile's device class: stack_knobs.py) gives the attention
    kernel, the element-wise implementation, whose fp8 GEMMs, the loss's vocabulary split and the overlaps; the
    shardlab stack with nothing set predicts what this model did before stacks. attention / implementation override
    the stack's kernels (compute.ATTENTION, elementwise.IMPLEMENTATIONS) for the benchmarks that compare kernels.
    Raises NotTimed for what the model does not time (untimed.py: fp8 on CPU ranks or on a GPU without fp8 cores)."""
    if (why := untimed_reason(spec, hw.kind, hw)) is not None:
        raise NotTimed(why)
    p, t = spec.parallel, spec.train
    g = gpus_per_node or hw.gpus_per_node
    knobs = stack_knobs(spec, hw)
    attention = attention or knobs.attention
    implementation = implementation or knobs.implementation
    if attention not in ATTENTION or implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention {attention!r} (one of {ATTENTION}), implementation {implementation!r} "
                         f"(one of {IMPLEMENTATIONS})")
    share, mb, n_stages = _timeshare(spec, hw), t.microbatches, p.pp * p.virtual_stages
    reps = [r * (p.dp_cp * p.tp) for r in range(p.pp)]  # one rank per pipeline rank (tp = dp = cp = ep index 0)
    layout = Layout.of(spec)
    ring = _ring(spec, hw, g, attention, layout, overlap=knobs.cp_ring_overlap)
    info = []
    fwd, bwd = [0.0] * n_stages, [0.0] * n_stages
    full = str(t.recompute) == "full"
    for k, r in enumerate(reps):
        params, stages = local_params_shared(spec, r), rank_stages(spec, r)
        ep_steady = steady_fraction(p, mb, k) if layout.ep_overlap else 0.0
        layers = sorted(i for s in stages for i in _layers(spec, s))
        kinds: dict[str, float] = {}
        comm = _mp_comm(spec, hw, g, layers, stages, layout, kinds)
        per_mb = (comm["tp"] + comm["ep"]) / mb
        hidden = _tp_hidden(spec, hw, g, params, layers, knobs)
        tot, hidden_mb, hidden_ep_mb = PassCost(), 0.0, 0.0
        for s in stages:
            c = stage_cost(spec, hw, s, params, attention, layout, implementation, fp8_gemms=knobs.fp8_gemms,
                           vocab_shards=knobs.vocab_shards)
            _add_dispatch(spec, hw, c, params, s)
            tot.add(c)
            share_s = len(_layers(spec, s)) / max(1, len(layers))
            n_stage = len(_layers(spec, s))
            hid_f, hid_b = _stage_hidden(spec, hidden, _layers(spec, s))
            hidden_mb += hid_f * (2 if full else 1) + hid_b
            hid_ep = hidden_ep_s(comm["ep"] / mb * share_s, c.fwd_s + c.bwd_s + c.recompute_s, ep_steady)
            hidden_ep_mb += hid_ep
            fwd[s] = (c.fwd_s + per_mb / 2 * share_s - hid_f - hid_ep / 2 + n_stage * ring.fwd_exposed_s) * share
            rc_comm = per_mb / 2 * share_s - hid_f if full else 0.0  # the re-run forward's collectives
            bwd[s] = (c.bwd_s + c.recompute_s + (per_mb / 2 * share_s - hid_b - hid_ep / 2 + rc_comm)
                      + n_stage * ring.bwd_exposed_s) * share
        info.append((r, params, stages, layers, comm, tot, kinds, hidden_mb, hidden_ep_mb))
    hop = p2p_hop_s(spec, hw, g) * share
    span0, busy, span1 = _pipeline(spec, fwd, bwd, hop, overlap=knobs.pp_overlap)
    out = []
    for k, (r, params, _stages, layers, comm, tot, kinds, hidden_mb, hidden_ep_mb) in enumerate(info):
        rc = 1.5 if str(t.recompute) == "full" else 1.0  # full recompute repeats the forward's 2 of 4 collectives
        dp_kinds: dict[str, float] = {}
        dp_total, dp_exp = dp_exposed(spec, hw, g, params, tot, dp_kinds, grad_overlap=knobs.grad_overlap,
                                      gather_overlap=knobs.gather_overlap)
        kinds = {c: (kinds.get(c, 0.0) * rc + dp_kinds.get(c, 0.0)) * share for c in {*kinds, *dp_kinds}}
        compute = mb * (tot.fwd_s + tot.bwd_s + tot.recompute_s) * share
        comm = {k: v * (rc if k in ("tp", "ep") else 1.0) for k, v in comm.items()}
        cp_exp = mb * len(layers) * (ring.fwd_exposed_s + ring.bwd_exposed_s) * share
        cp_kinds = {"all_gather": mb * len(layers) * ring.all_gather_s,
                    "all_to_all": mb * len(layers) * ring.all_to_all_s,
                    "reduce_scatter": mb * len(layers) * ring.reduce_scatter_s}
        kinds = {c: kinds.get(c, 0.0) + cp_kinds.get(c, 0.0) * share
                 for c in {*kinds, *(k for k, v in cp_kinds.items() if v)}}
        tp_exp = (comm["tp"] - mb * hidden_mb) * share if hidden_mb else comm["tp"] * share
        ep_exp = (comm["ep"] - mb * hidden_ep_mb) * share
        mp_exp = tp_exp + ep_exp + cp_exp
        exposed = {"tp": tp_exp, "ep": ep_exp, **({"cp": cp_exp} if p.cp > 1 else {}),
                   "pp": span1 - span0, "dp": dp_exp * share}
        opt = _optimizer_s(spec, hw, params, implementation) * share
        zero_grad = memory_s(hw, 4 * derived(params, "numel_sums", _numel_sums)[2])
        other = hw.tune.step_overhead_s + (zero_grad + fsdp_host_s(spec, hw, params)) * share
        bubble = max(0.0, span0 - busy[k])
        step = span1 + exposed["dp"] + opt + other
        out.append(RankTime(rank=r, pp_rank=k, step_s=step, compute_s=compute, recompute_s=mb * tot.recompute_s * share,
                            exposed_comm_s=sum(exposed.values()), bubble_s=bubble, optimizer_s=opt, other_s=other,
                            comm_s={"tp": comm["tp"] * share, "ep": comm["ep"] * share,
                                    **({"cp": mb * len(layers) * ring.comm_s * share} if p.cp > 1 else {}),
                                    "pp": span1 - span0, "dp": dp_total * share}, exposed_by_dim_s=exposed,
                            comm_by_collective_s=kinds))
        parts = {"compute": compute, "exposed tp / ep / cp": mp_exp, "bubble": bubble, "pp p2p": exposed["pp"],
                 "exposed dp": exposed["dp"], "optimizer": opt, "other": other}
        check_parts_sum(r, parts, step)
    slow = max(out, key=lambda x: x.step_s)
    notes = [f"attention={attention}", f"implementation={implementation}",
             f"gpus_per_node={g}"] + ([f"{p.world_size} ranks time-share {hw.cores} cores (x{share:.2f})"]
                                                               if share > 1 else [])
    caveats = list(knobs.caveats)
    if knobs.resolved.values["ep_overlap"] and p.ep > 1 and not layout.ep_overlap:
        caveats.append("ep_overlap runs with virtual stages under pp and without full recompute (Megatron-Core refuses "
                       "the rest): the EP all-to-alls predicted exposed")
    caveats += [n for n in [hw.peak_note(spec.train.precision)] if n]
    notes += ([knobs.echo] if knobs.echo else []) + caveats
    return StepTime(hardware=hw.key, per_rank=out, summary=summarise(spec, hw, slow, band), notes=notes,
                    caveats=caveats, stage_fwd_s=fwd, stage_bwd_s=bwd)


def _tp_hidden(spec: ExperimentSpec, hw: Hardware, g: int, params: list, layers: list[int],
               knobs: StackKnobs) -> HiddenTp | None:
    """The TP collectives one block hides behind its GEMMs (tp_overlap.py), None without the overlap."""
    if not knobs.tp_overlap or not layers:
        return None
    m = spec.model
    dense = [i for i in layers if not m.layer_is_moe(i)]
    torch_tp = knobs.resolved.tp_overlap_impl != "transformer_engine"
    return hidden_tp(spec, hw, params, (dense or layers)[0], g, knobs.fp8_gemms, fuses_summed_dgrads=not torch_tp,
                     gathers_feed_matmuls=not (torch_tp and knobs.fp8_gemms in ROWWISE_GEMMS))


def _stage_hidden(spec: ExperimentSpec, hidden: HiddenTp | None, layers: range) -> tuple[float, float]:
    """(forward, backward) TP seconds the stage's blocks hide per microbatch."""
    if hidden is None:
        return 0.0, 0.0
    f = b = 0.0
    for i in layers:
        lf, lb = hidden.per_layer(not spec.model.layer_is_moe(i))
        f, b = f + lf, b + lb
    return f, b


def _ring(spec: ExperimentSpec, hw: Hardware, g: int, attention: str, layout: Layout, *, overlap: bool) -> RingTime:
    """CP's ring transfers per layer and microbatch against this rank's attention blocks (cp_ring.py)."""
    return ring_time(spec.model, layout, hw, attention_pass(spec.model, layout, hw, attention),
                     rotate=str(spec.parallel.cp_rotate), gpus_per_node=g, overlap=overlap)


def _layers(spec: ExperimentSpec, stage: int) -> range:
    return stage_layers(spec.model.n_layers, spec.parallel.pp * spec.parallel.virtual_stages, stage)


def _pipeline(spec: ExperimentSpec, fwd: list[float], bwd: list[float], hop: float,
              overlap: bool = False) -> tuple[float, list[float], float]:
    """(makespan without p2p, busy per pp rank, makespan with p2p). overlap: the p2p runs behind compute in the
    steady state (Megatron's overlap_p2p_comm), so only the ramp up and down crosses its p - 1 hops each way."""
    p, mb = spec.parallel, spec.train.microbatches
    sched, v = str(p.pp_schedule), p.virtual_stages
    if overlap and p.pp > 1 and hop:
        span0, busy, _ = _pipeline(spec, fwd, bwd, 0.0)
        return span0, busy, span0 + 2 * (p.pp - 1) * hop
    if p.pp == 1:
        busy = mb * (fwd[0] + bwd[0])
        return busy, [busy], busy
    if sched in SIMULATED:
        if not hop:
            span0, busy = makespan(sched, p=p.pp, v=v, m=mb, fwd_s=fwd, bwd_s=bwd)
            return span0, busy, span0
        return makespan_pair(sched, p=p.pp, v=v, m=mb, fwd_s=fwd, bwd_s=bwd, p2p_s=hop)
    busy = [mb * sum(fwd[s] + bwd[s] for s in rank_stages(spec, r * p.dp_cp * p.tp)) for r in range(p.pp)]
    span0 = max(busy) * (1 + bubble_over_ideal(sched, p=p.pp, m=mb, v=v))  # Qi 2023 Sec 2.1 / Sec 6
    return span0, busy, span0 + 2 * (p.pp - 1) * hop  # ramp up and down cross p-1 hops each (Narayanan 2021 Sec 2.2.1)


def model_flops_per_step(spec: ExperimentSpec, *, recompute: bool) -> float:
    m, t = spec.model, spec.train
    return training_flops_per_step(m, tokens=spec.tokens_per_step, recompute=str(t.recompute) if recompute else "none",
                                   rerun=flops_rerun(spec) if recompute else None)


def summarise(spec: ExperimentSpec, hw: Hardware, r: RankTime, band: tuple[float, float] | None) -> dict[str, float]:
    n, peak = spec.parallel.world_size, hw.peak(spec.train.precision)
    lo, hi = band or (-UNCALIBRATED_BAND, UNCALIBRATED_BAND)
    step = r.step_s
    return {"step_s": step, "low_s": step * (1 + lo), "high_s": step * (1 + hi), "compute_s": r.compute_s,
            "exposed_comm_s": r.exposed_comm_s, "bubble_s": r.bubble_s, "optimizer_s": r.optimizer_s,
            "other_s": r.other_s, "tokens_per_s": spec.tokens_per_step / step,
            "tflops_per_gpu": model_flops_per_step(spec, recompute=True) / (step * n) / 1e12,
            "mfu": model_flops_per_step(spec, recompute=False) / (step * n * peak)}
