"""The search space: every layout of a model on N GPUs that the analytic model can predict (pure Python + numpy).

`enumerate_layouts` returns one `Layout` whose fields are arrays, one entry per candidate: the degrees of the dimension
table (backend/spec/dims.py: dp, tp, pp, ep, cp, from `degree_space`), ZeRO stage, micro-batch, recompute, pipeline
schedule, virtual stages, sequence parallel (analytic/layout.py). Only
arithmetic constraints are applied here (divisibility, the spec's schedule rules); "runnable on this machine" is
not a constraint (ExperimentSpec.for_prediction).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from backend.analytic.expert_layout import folds_experts
from backend.analytic.layout import CHOICES, SCHEDULE_NAMES, Layout, PipelineSchedule, RecomputeMode, ZeroStage
from backend.analytic.memory.state_floor import STATE_KEY
from backend.analytic.stack_memory import NO_COMPILE, EngineCompile
from backend.recompute_policy import KINDS
from backend.spec import ExperimentSpec, ModelSpec, ParallelSpec, RuntimeSpec, TrainSpec, dims
from backend.spec.choices import Device, expert_grid_fits
from backend.spec.stacks import Repertoire


@dataclass(frozen=True)
class Limits:
    max_tp: int | None = None
    """Largest tp (default: GPUs per node: TP across nodes is never competitive, Narayanan 2021 Sec 3.3 takeaway 1)."""
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    virtual_stages: tuple[int, ...] = (2, 4)
    max_cp: int = 32
    """Largest context-parallel degree (Llama 3 trains 128k contexts at cp 16, Dubey 2024 Sec 3.3.2; torchtitan's
    long-context recipes go to 32). cp is searched only for flash attention (spec.checks: ring attention needs it)
    and where the sequence splits into 2cp equal chunks."""


DEFAULT_LIMITS = Limits()
"""The search limits when a caller gives none (one frozen instance, as the former `Limits()` default was)."""


@dataclass(frozen=True)
class DegreePoint:
    """A split of the GPUs over the in-world degrees (tp, pp, cp; dp takes the ranks they leave), every combination
    of the carved degrees it admits (ep, carved out of dp x cp) and the (schedule, virtual stages) pairs it admits."""
    degrees: dict[str, int]
    carved: list[tuple[int, ...]]
    """One degree per carved dimension (dims.DIMS order), per admitted combination."""
    schedules: list[tuple[int, int]]


@dataclass(frozen=True)
class Search:
    """What a model admits of its degrees on one search: the model, the limits, the GPUs of a node."""
    model: Any
    limits: Limits
    gpus_per_node: int


def _tp_admitted(s: Search, tp: int, at: dict[str, int]) -> bool:
    """At most a node (TP across nodes is never competitive, Narayanan 2021 Sec 3.3), dividing heads, KV heads, MLP."""
    m = s.model
    return tp <= (s.limits.max_tp or s.gpus_per_node) and not (m.n_heads % tp or m.kv_heads % tp or m.ffn % tp)


def _pp_admitted(s: Search, pp: int, at: dict[str, int]) -> bool:
    return pp <= s.model.n_layers


def _cp_admitted(s: Search, cp: int, at: dict[str, int]) -> bool:
    """spec.checks._check_context_parallel: ring attention needs flash and seq_len in 2cp equal chunks."""
    if str(getattr(s.model, "attention", "math")) != "flash":
        return cp == 1
    return cp <= s.limits.max_cp and s.model.seq_len % (2 * cp) == 0


def _ep_admitted(s: Search, ep: int, at: dict[str, int]) -> bool:
    """ep dividing n_experts, with or without pipelining and with tp as Megatron and torchtitan allow (DeepSeek-V3
    trained PP16 x EP64, DeepSeek-V3 report Sec 3.2); whole experts on every tp rank (analytic/expert_layout.py)."""
    m = s.model
    return m.n_experts % ep == 0 if m.is_moe else ep == 1


def _etp_admitted(s: Search, etp: int, at: dict[str, int]) -> bool:
    """spec.checks._check_expert_tp: etp | tp (a divisor of the tp ranks it is carved out of) and | expert_ffn."""
    m = s.model
    return m.expert_ffn % etp == 0 if m.is_moe else etp == 1


ADMITS: dict[str, Callable[[Search, int, dict[str, int]], bool]] = {
    "tp": _tp_admitted, "pp": _pp_admitted, "cp": _cp_admitted, "ep": _ep_admitted, "etp": _etp_admitted}
"""What a model admits of a degree (given the degrees chosen before it): spec.checks' arithmetic and the search's
limits. A dimension without an entry is searched over every divisor of the ranks it splits."""


def _carved_admitted(names: tuple[str, ...], combo: tuple[int, ...], degrees: dict[str, int], folded: bool) -> bool:
    """A combination of carved degrees: etp > 1 only with ep > 1 (at ep 1 the experts split over tp, etp = tp), and an
    ep the stage's expert grid holds (spec.choices.expert_grid_fits: on a folded grid ep may span the tp ranks)."""
    at = dict(zip(names, combo, strict=False))
    ep, etp = at.get("ep", 1), at.get("etp", 1)
    if etp > 1 and ep == 1:
        return False
    return expert_grid_fits(degrees.get("tp", 1), degrees.get("dp", 1) * degrees.get("cp", 1), ep, etp, folded)


def degree_space(dimensions: tuple[dims.Dim, ...], model: Any, *, gpus: int, gpus_per_node: int,
                 limits: Limits, expert_fold: bool = False) -> list[DegreePoint]:
    """Every split of `gpus` over the dimensions' degrees the model admits: the in-world ones but the remainder in
    table order (tp outermost), each a divisor of the ranks the earlier ones leave, the remainder (dp) taking the
    rest; then each carved degree a divisor of the ranks it is carved out of (ep of dp x cp). expert_fold: the
    stack's experts sit on Megatron-Core's folded grid (analytic/expert_layout.py), so ep may also reach into tp."""
    search = Search(model, limits, gpus_per_node)
    split = [d for d in dimensions if d.in_world and not d.remainder]
    rest = dims.remainder(dimensions).name
    carved = [d for d in dimensions if not d.in_world]
    points: list[DegreePoint] = []

    def walk(i: int, left: int, at: dict[str, int]) -> None:
        if i < len(split):
            admits = ADMITS.get(split[i].name, _any_divisor)
            for degree in _divisors(left):
                if admits(search, degree, at):
                    walk(i + 1, left // degree, {**at, split[i].name: degree})
            return
        at = {**at, rest: left}
        options = [[e for e in _divisors(math.prod(at[n] for n in d.carved_from) * _folded_over(d, at, expert_fold))
                    if ADMITS.get(d.name, _any_divisor)(search, e, at)] for d in carved]
        names = tuple(d.name for d in carved)
        combos = [c for c in itertools.product(*options) if _carved_admitted(names, c, at, expert_fold)]
        points.append(DegreePoint(at, combos,
                                  _schedules(at["pp"], model.n_layers, limits.virtual_stages)))

    walk(0, gpus, {})
    return points


def _folded_over(d: dims.Dim, at: dict[str, int], expert_fold: bool) -> int:
    """The extra ranks a carved degree may span: ep over the tp ranks on the folded expert grid, else none."""
    return at.get("tp", 1) if expert_fold and d.name == "ep" else 1


def _any_divisor(s: Search, degree: int, at: dict[str, int]) -> bool:
    return True


SEARCHED_RECOMPUTE = (RecomputeMode.NONE, RecomputeMode.SELECTIVE, RecomputeMode.FULL, RecomputeMode.OP,
                      RecomputeMode.LAYERS, RecomputeMode.BLOCK)
"""The recompute policies searched: none, selective, full, op (torchtitan's op SAC, its op list), layers:2 (torchtitan's
layer SAC, every second block) and block:N with N = half the blocks of a pipeline rank (Megatron's block method)."""


def recompute_layers(kind: np.ndarray, pp: np.ndarray, n_layers: int) -> np.ndarray:
    """K / N of the searched policies: 2 for layers, half a pipeline rank's blocks (at least 1) for block, else 0."""
    return np.where(kind == RecomputeMode.LAYERS, 2,
                    np.where(kind == RecomputeMode.BLOCK, np.maximum(1, n_layers // (2 * pp)), 0))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _schedules(pp: int, n_layers: int, virtual_stages: tuple[int, ...]) -> list[tuple[int, int]]:
    """(schedule, virtual stages) pairs a pp degree admits (backend/spec/checks.py _check_pipeline)."""
    if pp == 1:
        return [(PipelineSchedule.ONE_F_ONE_B, 1)]
    out = [(PipelineSchedule.ONE_F_ONE_B, 1), (PipelineSchedule.GPIPE, 1)]
    out += [(PipelineSchedule.INTERLEAVED_1F1B, v) for v in virtual_stages if pp * v <= n_layers]
    out += [(PipelineSchedule.ZERO_BUBBLE, v) for v in virtual_stages[:1] if pp * v <= n_layers]  # torch's ZB-H1
    # the V schedules: ZBV and DualPipeV (DeepSeek-V3's, DeepSeek-V3 report Sec 3.2.1), 2 stages per rank
    return out + ([(PipelineSchedule.ZBV, 2), (PipelineSchedule.DUALPIPEV, 2)] if pp * 2 <= n_layers else [])


def _in_repertoire(r: Repertoire, schedule: np.ndarray, kinds: np.ndarray, searched: int,
                   pp: np.ndarray) -> np.ndarray:
    """The grid's (schedule, flavour, recompute) cells the framework configures (schedule: the grid's schedule axis,
    -1 padding; kinds: the recompute axis, its first `searched` the planner's own; pp: the points' pp on axis 0)."""
    allowed = np.asarray([SCHEDULE_NAMES.index(n) for n in r.schedules], dtype=np.int64)
    shape = (1, 1, 1, 1, 1, len(kinds), 1)
    own = np.asarray([KINDS[int(k)] in r.recompute_kinds or i >= searched for i, k in enumerate(kinds)]).reshape(shape)
    zero = np.arange(len(ZeroStage.ALL)).reshape(1, 1, -1, 1, 1, 1, 1)
    return np.isin(schedule, allowed) & own & ((pp == 1) | (zero <= r.pp_zero_stage_max))


def _ddp_where_it_runs(moe: bool, dp: np.ndarray, ep: np.ndarray, model_parallel: dict[str, np.ndarray]) -> np.ndarray:
    """The grid cells a stack that runs plain data parallel only alone configures (spec/stack_rules.ddp_runs_alone):
    not DDP over dp > 1 beside ep, nor, in a dense model, beside tp / pp / cp."""
    beside = ep > 1
    if not moe:
        beside = beside | (model_parallel["tp"] > 1) | (model_parallel["pp"] > 1) | (model_parallel["cp"] > 1)
    ddp = np.arange(len(ZeroStage.ALL)).reshape(1, 1, -1, 1, 1, 1, 1) == ZeroStage.DDP
    return ~ddp | (dp == 1) | ~beside


def enumerate_layouts(model: Any, *, gpus: int, gpus_per_node: int, global_batch: int,
                      limits: Limits = DEFAULT_LIMITS, precision: str = "bf16-mixed", optimizer: str = "adamw",
                      extra_recompute: tuple[tuple[str, int], ...] = (), sac_ops: tuple[str, ...] | None = None,
                      device: str = "cpu", stack: Any = None, repertoire: Repertoire | None = None,
                      compiled: EngineCompile = NO_COMPILE) -> Layout:
    """Every valid layout: the degree points in Python (`degree_space` over backend/spec/dims.py's table), then one
    boolean grid over (point, carved degrees (ep), flavour, micro-batch, schedule, recompute, SP) with the
    point-dependent choices padded and masked, rows in that nesting order.
    extra_recompute: (kind, K) policies searched after SEARCHED_RECOMPUTE (a held one, planner/held.py; a row equal to
    a searched one is dropped); sac_ops: the ops `op` saves (None: torchtitan's list); device: where the ranks run
    ("cuda" on a GPU profile: planner.search); stack: the layouts' stack memory terms (Layout.stack); repertoire: the
    schedules and searched recompute policies the stack's framework configures (spec/stacks.Repertoire; a held policy
    is the spec's own and stays); compiled: what stack shardlab compiles (Layout.loss_compiled, blocks_compiled)."""
    pairs = degree_space(dims.DIMS, model, gpus=gpus, gpus_per_node=gpus_per_node, limits=limits,
                         expert_fold=folds_experts(stack))
    table: dict[str, Any] = {"device": device, "stack": stack, "compiled": compiled}
    if sac_ops is not None:
        table["sac_ops"] = tuple(sac_ops)
    if not pairs:
        return Layout.table(np.zeros((0, len(CHOICES)), dtype=np.int64), global_batch=global_batch, precision=precision,
                            optimizer=optimizer, **table)
    n_eps, n_schedules = max(len(x.carved) for x in pairs), max(len(x.schedules) for x in pairs)
    degree = {d: np.array([x.degrees[d] for x in pairs], dtype=np.int64) for d in pairs[0].degrees}
    tp, pp, dp = degree["tp"], degree["pp"], degree["dp"]
    carved = [d.name for d in dims.DIMS if not d.in_world]
    eps = np.array([x.carved + [(0,) * len(carved)] * (n_eps - len(x.carved)) for x in pairs],  # 0 = padding
                   dtype=np.int64).reshape(len(pairs), n_eps, len(carved))
    schedules = np.array([x.schedules + [(-1, 0)] * (n_schedules - len(x.schedules)) for x in pairs], dtype=np.int64)
    micro_batches = np.array(limits.micro_batches, dtype=np.int64)
    kinds = np.asarray(SEARCHED_RECOMPUTE + tuple(RecomputeMode.ALL[KINDS.index(k)] for k, _ in extra_recompute),
                       dtype=np.int64)
    held_layers = np.asarray([0] * len(SEARCHED_RECOMPUTE) + [n for _, n in extra_recompute], dtype=np.int64)
    # axes: pair, ep, flavour, micro-batch, schedule, recompute, SP (flavour and recompute constrain nothing)
    shape = (len(pairs), n_eps, len(ZeroStage.ALL), len(micro_batches), n_schedules, len(kinds), 2)
    axis = lambda a, i: a.reshape([-1 if k == i else 1 for k in range(len(shape))])  # noqa: E731
    pair_tp, pair_pp, pair_dp = axis(tp, 0), axis(pp, 0), axis(dp, 0)
    ep = (eps > 0).all(axis=2).reshape(len(pairs), n_eps, 1, 1, 1, 1, 1)  # a combination, not padding
    schedule = schedules[:, :, 0].reshape(len(pairs), 1, 1, 1, n_schedules, 1, 1)
    b, sp = axis(micro_batches, 3), axis(np.arange(2), 6)
    divides = global_batch % (b * pair_dp) == 0
    microbatches = np.where(divides, global_batch // (b * pair_dp), 0)
    needs_divisible = (schedule == PipelineSchedule.INTERLEAVED_1F1B) | (schedule == PipelineSchedule.ZERO_BUBBLE) \
        | (schedule == PipelineSchedule.ZBV)
    ok = ep & (schedule >= 0) & ((sp == 0) | (pair_tp > 1)) & divides
    if repertoire is not None:
        ok = ok & _in_repertoire(repertoire, schedule, kinds, len(SEARCHED_RECOMPUTE), pair_pp)
        if repertoire.ddp_alone:  # stack_rules.ddp_runs_alone, on the grid
            ep_degree = eps[:, :, carved.index("ep")].reshape(len(pairs), n_eps, 1, 1, 1, 1, 1)
            model_parallel = {d: axis(degree[d], 0) for d in ("tp", "pp", "cp")}
            ok = ok & _ddp_where_it_runs(model.is_moe, pair_dp, ep_degree, model_parallel)
    ok = ok & ((pair_pp == 1) | (schedule == PipelineSchedule.GPIPE) | (microbatches >= pair_pp))
    ok = ok & ((pair_pp == 1) | ~needs_divisible | (microbatches % pair_pp == 0))
    ok = ok & ((pair_pp == 1) | (schedule != PipelineSchedule.DUALPIPEV) | (microbatches >= 2 * pair_pp))
    pair_at, ep_at, zero, b_at, schedule_at, recompute, sp_at = np.nonzero(np.broadcast_to(ok, shape))
    # every column a 1-D gather from a small per-point table (2-D fancy indexing over ~1M rows is several times slower)
    pair_ep, pair_schedule = pair_at * n_eps + ep_at, pair_at * n_schedules + schedule_at
    searched = np.arange(len(kinds)) < len(SEARCHED_RECOMPUTE)
    layers_at = np.where(searched[None, :], recompute_layers(kinds[None, :], pp[:, None], model.n_layers),
                         held_layers[None, :])  # (point, recompute)
    columns = dict(**{d: v[pair_at] for d, v in degree.items()},
                   **{d: eps[:, :, i].reshape(-1)[pair_ep] for i, d in enumerate(carved)}, zero_stage=zero,
                   micro_batch=micro_batches[b_at], recompute=kinds[recompute],
                   schedule=schedules[:, :, 0].reshape(-1)[pair_schedule],
                   virtual_stages=schedules[:, :, 1].reshape(-1)[pair_schedule], sequence_parallel=sp_at,
                   recompute_layers=layers_at.reshape(-1)[pair_at * len(kinds) + recompute])
    # the state floor's grouping (memory/state_floor.py), from the grid: degrees (pair, ep), flavour, schedule, and
    # whether there is more than one microbatch
    state = ((pair_ep * len(ZeroStage.ALL) + zero) * n_schedules + schedule_at) * 2 \
        + (microbatches > 1).reshape(len(pairs), len(micro_batches))[pair_at, b_at]
    if extra_recompute:  # a held policy equal to a searched one (layers:2, or block:N at half a stage) once
        rows = np.stack([columns[c] for c in CHOICES], axis=1)
        _, first = np.unique(rows, axis=0, return_index=True)
        out = Layout.table(rows[np.sort(first)], global_batch=global_batch, precision=precision, optimizer=optimizer,
                           **table)
        state = state[np.sort(first)]
    else:
        out = Layout.of_columns({c: np.ascontiguousarray(columns[c], dtype=np.int64) for c in CHOICES},
                                global_batch=global_batch, precision=precision, optimizer=optimizer, **table)
    out.memoised(STATE_KEY, lambda: state)
    return out


def light_spec(data: dict[str, Any]) -> ExperimentSpec:
    """An ExperimentSpec built without validation (the planner's layouts are valid by construction): microbatches
    and dp filled in as backend/spec/checks.py would derive them."""
    train, parallel = dict(data["train"]), dict(data["parallel"])
    train.setdefault("microbatches", train["global_batch"] // (train["micro_batch"] * parallel["dp"]))
    return ExperimentSpec.model_construct(name=data.get("name", ""), model=ModelSpec.model_construct(**data["model"]),
                                          train=TrainSpec.model_construct(**{**TrainSpec().model_dump(), **train}),
                                          parallel=ParallelSpec.model_construct(**{**ParallelSpec().model_dump(),
                                                                                     **parallel}),
                                          runtime=RuntimeSpec.model_construct(**{**RuntimeSpec().model_dump(),
                                                                                   **_runtime(data)}))


def _runtime(data: dict[str, Any]) -> dict[str, Any]:
    """The planned spec's runtime fields, its device as the spec's own enum (Layout.spec_dict writes a string)."""
    runtime = dict(data.get("runtime") or {})
    if "device" in runtime:
        runtime["device"] = Device(runtime["device"])
    return runtime
