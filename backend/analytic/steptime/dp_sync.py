"""Data-parallel gradient / parameter sync of one rank per step (pure Python): seconds per collective and how
much of it the rank's compute hides. DDP's bucketed all-reduce overlaps the last microbatch's backward, the last
bucket cannot (Li et al. 2020, "PyTorch Distributed", VLDB, Sec 3.2.3; 25 MB buckets); FSDP2 all-gathers are
prefetched behind forward/backward and reduce-scatters run behind backward, except the first gather and the last
reduce-scatter (Zhao et al. 2023, "PyTorch FSDP", VLDB, Sec 3.3); ZeRO-1's parameter broadcast follows the
optimizer step, exposed; the distributed optimizer (zero1 x tp/pp) reduce-scatters each bucket as the last
backward completes it (the last bucket exposed) and all-gathers the params after the step, exposed.
FSDP2 copies every unit in and out of its collective buffers (and casts to the param / reduce dtypes) even on a
data-parallel group of one (a pure ZeRO-2/3 run on one GPU): those copies stay, the collectives vanish. Under zero3
the pre-backward hook re-gathers each unit on the autograd thread before its backward kernels are launched, so its
host time (Tunables.fsdp_unit_host_s, measured per hook call) is on the critical path once per unit and microbatch.

The collectives' seconds do not depend on the microbatch's compute, so they are computed once per rank's
parameter tuple and layout (`dp_colls`, memoised like the rest of the per-rank work) and only the overlap is
evaluated per call (`dp_exposed`), replaying the same additions in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import ceil
from typing import TYPE_CHECKING, Any

from backend.analytic.dp_buckets import bucket_groups, used_by
from backend.analytic.expert_layout import ExpertLayout
from backend.analytic.sharding import LocalParam, derived, fsdp_units, unsharded_numel
from backend.analytic.steptime.collectives import collective_s, dim_tier, members_per_node
from backend.analytic.steptime.compute import PassCost, memory_s
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.traffic import DDP_BUCKET_BYTES, dp_traffic, fsdp_gathers_per_step, fsdp_param_bytes

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec


@dataclass(frozen=True)
class DpColls:
    """One rank's data-parallel collectives per step, before overlap."""
    total_s: float
    kinds: dict[str, float]
    """Seconds by collective kind (all_reduce, broadcast, all_gather, reduce_scatter)."""
    exposure: tuple[tuple[str, float, float], ...]
    """In traffic order: (role, seconds, the part that cannot overlap). Roles: "grad", a gradient reduction that
    overlaps the last backward but its last bucket (DDP's all-reduce, the distributed optimizer's reduce-scatters);
    "gather", a parameter gather after the step (ZeRO-1's broadcast: tail = all of it; the distributed optimizer's
    all-gather: tail = one bucket's, for a stack that overlaps it with the next forward); "copy", FSDP2's copy-in /
    copy-out, always exposed."""
    fsdp_s: float
    fsdp_tail_s: float
    """The largest single FSDP2 gather / reduce-scatter (one unit's, per call)."""


def dp_colls(spec: ExperimentSpec, hw: Hardware, g: int, params: Sequence[LocalParam]) -> DpColls:
    """The rank's DpColls, memoised per shared params tuple on every input it reads (the params fix the model,
    the degrees, the schedule's placement and the rank; the key adds the flavour, microbatches, pp, the FSDP
    parameter bytes, the node size and the hardware)."""
    p, t = spec.parallel, spec.train
    key = ("dp_colls", p.ep, p.zero_stage, t.microbatches, p.pp, fsdp_param_bytes(spec), t.fp8_gathers, g, id(hw))
    return derived(params, key, lambda ps: _dp_colls(spec, hw, g, ps), keep=hw)


def _dp_colls(spec: ExperimentSpec, hw: Hardware, g: int, params: Sequence[LocalParam]) -> DpColls:
    p, mb = spec.parallel, spec.train.microbatches
    total = fsdp = fsdp_tail = 0.0
    kinds: dict[str, float] = {}
    exposure: list[tuple[str, float, float]] = []
    # memoised on every input dp_traffic reads (params fix the model)
    traffic = derived(params,
                      ("dp_traffic", p.ep, p.zero_stage, mb, p.pp, fsdp_param_bytes(spec), spec.train.fp8_gathers),
                      lambda ps: dp_traffic(spec, ps))
    seen: dict[tuple, float] = {}  # FSDP2 units repeat the same (collective, payload, group): same inputs, same seconds

    def coll_s(*args: Any, **kw: Any) -> float:
        key = (args, tuple(kw.items()))
        hit = seen.get(key)
        if hit is None:
            hit = seen[key] = collective_s(hw, *args, **kw)
        return hit

    groups: dict[int, tuple[str, int]] = {}
    distributed = used_by(spec)
    for kind, payload, n in traffic:
        tier_k = groups.get(n)
        if tier_k is None:
            tier_k = groups[n] = (dim_tier(spec, "dp", n, g), members_per_node(spec, "dp", n, g))
        tier, k = tier_k
        if kind == "all_reduce":
            buckets = max(1, ceil(payload / DDP_BUCKET_BYTES))
            s = coll_s(tier, kind, payload, n, calls=buckets, per_node=k)
            last = coll_s(tier, kind, min(payload, DDP_BUCKET_BYTES), n, per_node=k)
            exposure.append(("grad", s, last))  # Li 2020 Sec 3.2.3: overlaps the last backward
        elif distributed:  # the distributed optimizer: per bucket, once per step
            edp = ExpertLayout.of_spec(spec).edp if p.ep > 1 else None  # the expert buckets reduce over edp
            buckets = max(1, sum(1 for _, g in bucket_groups(params, p.dp_cp, edp) if g == n))
            s = coll_s(tier, kind, payload, n, calls=buckets, per_node=k)
            one = coll_s(tier, kind, payload / buckets, n, per_node=k)
            if kind == "reduce_scatter":  # launched as each bucket completes in the last backward; the last one exposed
                exposure.append(("grad", s, one))
            else:  # the all-gather of the updated params follows the step
                exposure.append(("gather", s, one))
        elif kind == "broadcast":
            # ZeroRedundancyOptimizer._sync_params runs after step(), exposed; it issues every parameter's broadcast
            # async and then waits for all (torch/distributed/optim/zero_redundancy_optimizer.py), so one latency
            s = coll_s(tier, kind, payload, n, calls=1, per_node=k)
            exposure.append(("gather", s, s))
        else:
            calls = fsdp_gathers_per_step(p.zero_stage, mb, pipelined=p.pp > 1) if kind == "all_gather" else (
                1 if p.pp > 1 else mb)
            s = coll_s(tier, kind, payload, n, calls=calls, per_node=k)
            # FSDP2 copies every unit into / out of the flat collective buffer on the compute stream
            # (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py foreach_all_gather / _copy_out; reduce-scatter
            # copy-in)
            copy = seen.get(("copy", payload, calls))
            if copy is None:
                copy = seen[("copy", payload, calls)] = memory_s(hw, 2 * payload, kernels=calls * 2)
            exposure.append(("copy", copy, copy))
            fsdp += s
            fsdp_tail = max(fsdp_tail, s / calls)
        total += s
        kinds[kind] = kinds.get(kind, 0.0) + s
    if not traffic and p.zero_stage >= 2 and p.tp == p.pp == p.ep == 1:  # FSDP2 on one rank: the copies alone
        exposure.extend(("copy", c, c) for c in _solo_fsdp_copies(spec, hw, params))
    return DpColls(total_s=total, kinds=kinds, exposure=tuple(exposure), fsdp_s=fsdp, fsdp_tail_s=fsdp_tail)


def _solo_fsdp_copies(spec: ExperimentSpec, hw: Hardware, params: Sequence[LocalParam]) -> list[float]:
    """Seconds of FSDP2's copy-in / copy-out per unit on a group of one: the payloads dp_traffic would all-gather
    (param dtype) and reduce-scatter (fp32), copied as they are for a real collective."""
    p, mb = spec.parallel, spec.train.microbatches
    gathers = fsdp_gathers_per_step(p.zero_stage, mb, pipelined=False)
    out = []
    for unit in fsdp_units(spec.model, params).values():
        full = unsharded_numel(unit)
        out.append(memory_s(hw, 2 * gathers * full * fsdp_param_bytes(spec), kernels=gathers * 2))
        out.append(memory_s(hw, 2 * mb * full * 4, kernels=mb * 2))
    return out


def fsdp_host_s(spec: ExperimentSpec, hw: Hardware, params: Sequence[LocalParam]) -> float:
    """Exposed host seconds of zero3's pre-backward re-gathers per step (module docstring): one hook per FSDP2 unit
    and microbatch."""
    p = spec.parallel
    if p.zero_stage != 3 or not hw.tune.fsdp_unit_host_s or not (p.dp_cp > 1 or p.tp == p.pp == p.ep == 1):
        return 0.0
    units = derived(params, "fsdp_unit_count", lambda ps: len(fsdp_units(spec.model, ps)))
    return hw.tune.fsdp_unit_host_s * units * spec.train.microbatches


def dp_exposed(spec: ExperimentSpec, hw: Hardware, g: int, params: Sequence[LocalParam], pass_total: PassCost,
               kinds: dict[str, float] | None = None, *, grad_overlap: bool | None = None,
               gather_overlap: bool | None = None) -> tuple[float, float]:
    """(seconds before overlap, exposed seconds) of data-parallel sync for one rank (module docstring); the seconds
    before overlap are also summed by collective into `kinds`. grad_overlap / gather_overlap: a stack's
    grad_reduce_overlap / param_gather_overlap (spec/stacks.py), None = this engine's behaviour: gradient reductions
    behind the last backward, parameter gathers after the step. A gather that overlaps hides behind the next step's
    first microbatch forward (Megatron's --overlap-param-gather: forward pre-hooks, distributed_data_parallel.py
    _make_forward_pre_hook) but for one bucket's; a reduction that does not overlap waits for the end of backward
    (Megatron without --overlap-grad-reduce: one bucket per buffer, distributed_data_parallel.py 164-171). FSDP2's
    prefetched gathers and reduce-scatters keep their own window below."""
    kinds = {} if kinds is None else kinds
    colls = dp_colls(spec, hw, g, params)
    for k, v in colls.kinds.items():
        kinds[k] = kinds.get(k, 0.0) + v
    eta, bwd = hw.tune.overlap_efficiency, pass_total.bwd_s
    grads = True if grad_overlap is None else grad_overlap
    gathers = False if gather_overlap is None else gather_overlap
    exposed = 0.0
    for role, s, tail in colls.exposure:
        if role == "grad" and grads:
            exposed += max(s - eta * bwd, tail)
        elif role == "gather" and gathers:
            exposed += max(s - eta * pass_total.fwd_s, tail)
        else:
            exposed += s
    if colls.fsdp_s:
        window = spec.train.microbatches * (pass_total.fwd_s + pass_total.bwd_s + pass_total.recompute_s)
        # Zhao 2023 Sec 3.3: first gather, last reduce-scatter
        exposed += max(colls.fsdp_s - eta * window, 2 * colls.fsdp_tail_s)
    return colls.total_s, exposed
