"""Predicted per-rank memory, communication, bubble and FLOPs of one experiment spec: `estimate(spec)`.

Memory is predicted for the moment the engine compares (backend/bench/memory.py): every MemTracker /
FSDPMemTracker category when activations peak (memory/rank_memory.py, the prediction core the planner calls too).
Communication per rank and step: traffic.py. Ranks are computed once per class of equivalent ranks
(rank_classes.py) and expanded per rank on demand: `Estimate.per_rank` is a sequence whose rows are built when
read, and `Estimate.page` / `to_dict(max_ranks=...)` expand one page, so a million ranks cost as much as a few.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from backend.analytic.device import device_notes, with_device
from backend.analytic.estimate_notes import estimate_notes
from backend.analytic.expert_layout import rank_coords
from backend.analytic.layout import Layout, RankPosition, ZeroStage
from backend.analytic.memory.activations import logits_held_in_backward, loss_backward_extra_bytes
from backend.analytic.memory.model_state import zero1_shares_of
from backend.analytic.memory.rank_memory import rank_memory, worst_rank_memory
from backend.analytic.memory.stack_activations import stack_loss_backward_extra
from backend.analytic.model_flops import training_flops_per_step
from backend.analytic.params import count_params, param_list
from backend.analytic.rank_classes import RankClass, RankClasses, rank_classes
from backend.analytic.recompute_cost import flops_rerun
from backend.analytic.sharding import local_params, rank_layers, rank_stages
from backend.analytic.textbook.comm_volume import ring_wire_bytes
from backend.analytic.textbook.pipeline import bubble_fraction
from backend.analytic.textbook.zero import precision_bytes, zero_model_state_bytes
from backend.analytic.traffic import rank_traffic

if TYPE_CHECKING:
    from backend.analytic.memory.zero1_share import Zero1Shares
    from backend.spec import ExperimentSpec

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "recv")


@dataclass
class RankEstimate:
    rank: int
    coords: dict[str, int]
    stages: list[int]
    layers: list[int]
    params_count: int
    """Parameter elements this rank owns (FSDP2: its unpadded shard)."""
    params_bytes: int = 0
    grads_bytes: int = 0
    optimizer_bytes: int = 0
    activations_bytes: int = 0
    other_bytes: int = 0
    total_bytes: int = 0
    optimizer_temp_bytes: int = 0
    """Transient bytes inside optimizer.step (not in total_bytes: the step runs after activations are freed)."""
    recv_buffer_bytes: int = 0
    """The pipeline stages' receive buffers (in activations_bytes; torch keeps them from step to step, so they are
    alive inside optimizer.step too); 0 without pipelining."""
    late_grads_bytes: int = 0
    """Gradients made only after the activation peak (DualPipeV's rank 0 at m = 2p: its first stage's), not in
    grads_bytes; alive inside optimizer.step."""
    loss_backward_temp_bytes: int = 0
    """What the start of the loss's backward adds to the end of forward + loss (the log-probs' and logits' fp32
    gradients, activations.loss_backward_extra_bytes), on the rank with the loss; 0 elsewhere."""
    loss_backward_bytes: int = 0
    """Total bytes at the start of the loss's backward (the end of forward + loss_backward_temp_bytes; under
    recompute the activation peak is later, in backward), on the rank with the loss; 0 elsewhere."""
    backward_bytes: int = 0
    """Total bytes at the fullest moment inside backward: the working block re-materialised with its backward's
    tensors, FSDP2's gathered parameters, unsharded gradients and reduce-scatter input (memory/backward_moment.py)."""
    comm_bytes: dict[str, float] = field(default_factory=dict)
    """Payload bytes per step per collective (size of the buffers handed to it)."""
    comm_wire_bytes: dict[str, float] = field(default_factory=dict)
    """Ring-algorithm bytes sent per step per collective (comm.ring_wire_bytes, each with its group size)."""

    def moments(self) -> dict[str, int]:
        """Bytes at each moment that can be this rank's fullest: the activation peak (total_bytes), inside
        optimizer.step (activations freed, the update's temporaries alive), the start of the loss's backward, the
        fullest moment inside backward."""
        return {"activation_peak": self.total_bytes,
                "optimizer_step": (self.total_bytes - self.activations_bytes + self.optimizer_temp_bytes
                                   + self.recv_buffer_bytes + self.late_grads_bytes),
                "loss_backward": self.loss_backward_bytes, "backward": self.backward_bytes}

    def fullest_bytes(self) -> int:
        """The "fits" check's need before the runtime allowance: the largest of `moments`."""
        return max(self.moments().values())

    def fullest_moment(self) -> str:
        """Which of `moments` is the fullest (the first of equals, in `moments` order)."""
        moments = self.moments()
        return max(moments, key=moments.__getitem__)

    def to_dict(self) -> dict[str, Any]:
        """dataclasses.asdict's result, built directly (a page of a million-rank estimate prints 1,024 of these), with
        `fullest_bytes` and `fullest_moment`."""
        out = {f: getattr(self, f) for f in _RANK_FIELDS}
        for f in ("coords", "comm_bytes", "comm_wire_bytes"):
            out[f] = dict(out[f])
        out["stages"], out["layers"] = list(self.stages), list(self.layers)
        out["fullest_bytes"], out["fullest_moment"] = self.fullest_bytes(), self.fullest_moment()
        return out


_RANK_FIELDS = ("rank", "coords", "stages", "layers", "params_count", "params_bytes", "grads_bytes", "optimizer_bytes",
                "activations_bytes", "other_bytes", "total_bytes", "optimizer_temp_bytes", "recv_buffer_bytes",
                "late_grads_bytes", "loss_backward_temp_bytes", "loss_backward_bytes", "backward_bytes", "comm_bytes",
                "comm_wire_bytes")


def estimate_rank(spec: ExperimentSpec, rank: int) -> RankEstimate:
    """One rank of a device-resolved spec, computed at its own position (the definition every rank of its class
    shares: Estimate.per_rank must reproduce it field for field)."""
    p = spec.parallel
    layout, position = Layout.of(spec), RankPosition.of_rank(spec, rank)
    memory = rank_memory(spec.model, layout, position)
    fsdp = p.zero_stage >= ZeroStage.ZERO2
    stages = rank_stages(spec, rank)
    r = RankEstimate(rank=rank, coords=rank_coords(spec, rank), stages=stages, layers=rank_layers(spec, stages),
                     params_count=memory.parts.total("real_numel" if fsdp else "local_numel"),
                     params_bytes=memory.params_bytes, grads_bytes=memory.grads_bytes,
                     optimizer_bytes=memory.optimizer_bytes, activations_bytes=memory.activations_bytes,
                     other_bytes=memory.other_bytes, total_bytes=memory.total_bytes,
                     loss_backward_bytes=int(memory.loss_backward_bytes), backward_bytes=int(memory.backward_bytes))
    params = local_params(spec, rank)
    r.optimizer_temp_bytes = int(memory.optimizer_temp_bytes)  # memory/optimizer_step.py: the local optimizer's order
    r.recv_buffer_bytes, r.late_grads_bytes = int(memory.recv_buffer_bytes), int(memory.late_grads_bytes)
    if layout.n_stages - 1 in stages and layout.stack is not None:  # a non-default stack's loss (stack_activations.py)
        r.loss_backward_temp_bytes = int(stack_loss_backward_extra(spec.model, layout))
    elif layout.n_stages - 1 in stages:
        r.loss_backward_temp_bytes = int(loss_backward_extra_bytes(
            s=spec.model.seq_len, b=layout.micro_batch, vocab=spec.model.vocab_size, dtype_bytes=layout.compute_bytes,
            logits_held=logits_held_in_backward(layout), fused_loss=layout.loss_compiled))
    for kind, payload, n in rank_traffic(spec, params, r.layers, stages):
        r.comm_bytes[kind] = r.comm_bytes.get(kind, 0.0) + payload
        r.comm_wire_bytes[kind] = r.comm_wire_bytes.get(kind, 0.0) + ring_wire_bytes(kind, payload, n)
    return r


@dataclass
class ClassEstimate:
    """One class of equivalent ranks: its lowest rank's estimate and how many ranks share it."""
    members: RankClass
    representative: RankEstimate
    ranks: int
    zero1_shares: Zero1Shares | None = None
    """ZeRO-1: the partition its dp indices share (memory/zero1_share.Zero1Shares); None otherwise."""

    def at(self, rank: int, coords: dict[str, int], spec: ExperimentSpec) -> RankEstimate:
        d = self.representative
        r = replace(d, rank=rank, coords=coords, stages=list(d.stages), layers=list(d.layers),
                    comm_bytes=dict(d.comm_bytes), comm_wire_bytes=dict(d.comm_wire_bytes))
        if self.zero1_shares is not None:
            r.optimizer_bytes, r.optimizer_temp_bytes = self.zero1_shares.bytes(
                spec.parallel.data_parallel_index(rank), str(spec.train.optimizer), str(spec.runtime.device))
            r.total_bytes = r.params_bytes + r.grads_bytes + r.optimizer_bytes + r.activations_bytes + r.other_bytes
            shift = r.optimizer_bytes - d.optimizer_bytes  # the other moments hold the same optimizer state
            r.backward_bytes += shift
            r.loss_backward_bytes += shift if r.loss_backward_bytes else 0
        return r

    def distinct(self, spec: ExperimentSpec) -> list[tuple[RankEstimate, int]]:
        """(estimate of the lowest rank, rank count) per distinct prediction inside the class (ZeRO-1: per
        optimizer share)."""
        if self.zero1_shares is None:
            return [(self.representative, self.ranks)]
        c = self.members
        tp_count = len(c.tp_indices)
        groups = self.zero1_shares.groups(str(spec.train.optimizer), str(spec.runtime.device))
        owning = {dp for dps in groups.values() for dp in dps}
        out = []
        for dps in groups.values():
            mine = [dp for dp in dps if dp in c.dp_indices and dp % c.ep == c.ep_index]
            if mine:
                out.append((self._rank_at(mine[0], spec), len(mine) * tp_count))
        empty = c.dp_count - sum(1 for dp in owning if dp in c.dp_indices and dp % c.ep == c.ep_index)
        if empty:
            first = next(dp for dp in c.dp_members() if dp not in owning)
            out.append((self._rank_at(first, spec), empty * tp_count))
        return out

    def _rank_at(self, dp: int, spec: ExperimentSpec) -> RankEstimate:
        p = spec.parallel
        rank = (self.members.pp_rank * p.dp_cp + dp) * p.tp + self.members.tp_indices.start
        return self.at(rank, rank_coords(spec, rank), spec)


class RankRows(Sequence):
    """Estimate.per_rank: every rank's RankEstimate, built from its class when read (len is the world size)."""

    def __init__(self, spec: ExperimentSpec, classes: RankClasses, by_key: dict[tuple, ClassEstimate]):
        self._spec, self._classes, self._by_key = spec, classes, by_key

    def __len__(self) -> int:
        return self._spec.parallel.world_size

    def __getitem__(self, index: int | slice) -> RankEstimate | list[RankEstimate]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"rank {index} outside world size {len(self)}")
        coords = rank_coords(self._spec, index)
        return self._by_key[self._classes.key(index)].at(index, coords, self._spec)

    def __iter__(self) -> Iterator[RankEstimate]:
        return (self[i] for i in range(len(self)))


@dataclass
class Estimate:
    per_rank: Sequence[RankEstimate]
    params_total: int
    tokens_per_step: int
    flops_per_step: float
    bubble_fraction: float | None
    comm_bytes_per_step: dict[str, float]
    comm_wire_bytes_per_step: dict[str, float]
    zero_textbook: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    rank_classes: list[ClassEstimate] = field(default_factory=list, repr=False)
    spec: ExperimentSpec | None = field(default=None, repr=False)

    @property
    def world_size(self) -> int:
        return len(self.per_rank)

    def page(self, offset: int = 0, limit: int | None = None) -> list[RankEstimate]:
        """Ranks offset .. offset + limit - 1 (every rank from offset without a limit)."""
        stop = len(self.per_rank) if limit is None else min(len(self.per_rank), offset + max(0, limit))
        return [self.per_rank[i] for i in range(max(0, offset), stop)]

    @cached_property
    def distinct_ranks(self) -> list[tuple[RankEstimate, int]]:
        """(estimate, rank count) per distinct prediction, lowest rank first within each: what every rank is."""
        return [x for c in self.rank_classes for x in c.distinct(self.spec)]

    def worst(self, key: Callable[[RankEstimate], float] | None = None) -> RankEstimate:
        """The fullest rank (by its fullest moment, `RankEstimate.fullest_bytes`, or by `key`), the lowest-numbered
        among equals."""
        key = key or (lambda r: r.fullest_bytes())
        return max((r for r, _ in self.distinct_ranks), key=lambda r: (key(r), -r.rank))

    def to_dict(self, *, offset: int = 0, max_ranks: int | None = None) -> dict[str, Any]:
        """Every field as JSON-ready data; per_rank holds every rank unless a page is asked for (then
        "per_rank_page" says which, and "rank_classes" summarises every class of equivalent ranks)."""
        paged = max_ranks is not None and (offset > 0 or len(self.per_rank) > max_ranks)
        out = {"per_rank": [r.to_dict() for r in (self.page(offset, max_ranks) if paged else self.per_rank)]}
        out.update({k: getattr(self, k) for k in ("params_total", "tokens_per_step", "flops_per_step",
                                                  "bubble_fraction", "comm_bytes_per_step",
                                                  "comm_wire_bytes_per_step")})
        out["zero_textbook"], out["notes"] = self.zero_textbook, list(self.notes)
        if paged:
            shown = out["per_rank"]
            out["per_rank_page"] = {"offset": offset, "ranks": len(shown), "world_size": len(self.per_rank)}
            out["rank_classes"] = [{"ranks": n, **r.to_dict()} for r, n in self.distinct_ranks]
        return out


def zero_textbook(psi: float, *, dp: int, stage: int, precision: str, optimizer: str = "adamw") -> dict[str, Any]:
    """ZeRO paper model states per device (Rajbhandari 2020 Sec 5, Fig 1) for Ψ, N = dp, K."""
    pb, gb, k = precision_bytes(str(precision), str(optimizer))
    by_stage = {s: zero_model_state_bytes(psi, n=dp, stage=s, k=k, param_bytes=pb, grad_bytes=gb) for s in range(4)}
    return {"psi": psi, "n": dp, "k": k, "param_bytes": pb, "grad_bytes": gb, "stage": stage,
            **by_stage[stage], "by_stage": by_stage}


def _class_estimates(spec: ExperimentSpec) -> tuple[RankClasses, dict[tuple, ClassEstimate]]:
    classes = rank_classes(spec)
    out = {}
    for key, c in classes.classes.items():
        rep = estimate_rank(spec, c.representative(spec.parallel))
        shares = None
        layout = Layout.of(spec)
        if spec.parallel.zero_stage == ZeroStage.ZERO1 and not layout.distributed_optimizer and layout.stack is None:
            position = RankPosition.of_rank(spec, rep.rank)
            shares = zero1_shares_of(spec.model, layout, position, rank_memory(spec.model, layout, position).parts)
        out[key] = ClassEstimate(c, rep, c.ranks, shares)
    return classes, out


def estimate(spec: ExperimentSpec, *, device: str | None = None) -> Estimate:
    """Per-rank predicted memory and traffic of a validated ExperimentSpec, for ranks on `device` ("cpu" or
    "cuda"; None: spec.runtime.device, `auto` as cpu - see device.with_device)."""
    spec = with_device(spec, device)
    m, t, p = spec.model, spec.train, spec.parallel
    classes, by_key = _class_estimates(spec)
    reps = [c.representative for c in by_key.values()]
    psi = count_params(m)
    kinds = sorted({k for r in reps for k in r.comm_bytes}, key=COLLECTIVES.index)
    flops = training_flops_per_step(m, tokens=spec.tokens_per_step, recompute=str(t.recompute), rerun=flops_rerun(spec))
    bubble = None if p.pp == 1 else bubble_fraction(str(p.pp_schedule), p=p.pp, m=t.microbatches, v=p.virtual_stages)
    return Estimate(
        per_rank=RankRows(spec, classes, by_key), params_total=psi, tokens_per_step=spec.tokens_per_step,
        flops_per_step=flops, bubble_fraction=bubble,
        comm_bytes_per_step={k: max(r.comm_bytes.get(k, 0.0) for r in reps) for k in kinds},
        comm_wire_bytes_per_step={k: max(r.comm_wire_bytes.get(k, 0.0) for r in reps) for k in kinds},
        zero_textbook=zero_textbook(psi, dp=p.dp_cp, stage=p.zero_stage, precision=str(t.precision),
                                    optimizer=str(t.optimizer)),
        notes=estimate_notes(spec) + device_notes(spec, n_param_tensors=len(param_list(m)),
                                                    autocast=bool(Layout.of(spec).uses_autocast)),
        rank_classes=list(by_key.values()), spec=spec)


def estimate_raw(*, params: float, dp: int, zero_stage: int, precision: str,
                 optimizer: str = "adamw") -> dict[str, Any]:
    """Model-state bytes per device for a raw parameter count (ZeRO Sec 5): the `--params` CLI path."""
    return zero_textbook(params, dp=dp, stage=zero_stage, precision=precision, optimizer=optimizer)


def worst_rank_bytes(spec: ExperimentSpec) -> tuple[int, RankEstimate]:
    """(bytes at its fullest moment, breakdown at its activation peak) of the fullest rank of a spec's layout, from
    memory/rank_memory.worst_rank_memory: the rank at tp / dp / ep index 0 of the pipeline rank that peaks, with
    ZeRO-1's largest optimizer share (the planner's confirmation of what it reports; `rank` is that pipeline rank's
    first rank, its `moments` those of that position)."""
    p = spec.parallel
    layout = Layout.of(spec)
    total, pp_rank = worst_rank_memory(spec.model, layout)
    memory = rank_memory(spec.model, layout, RankPosition(pp_rank=pp_rank, largest_zero1_share=True))
    rank = pp_rank * p.dp_cp * p.tp
    stages = rank_stages(spec, rank)
    fsdp = p.zero_stage >= ZeroStage.ZERO2
    return int(total), RankEstimate(rank=rank, coords=rank_coords(spec, rank), stages=stages,
                                    layers=rank_layers(spec, stages),
                                    params_count=memory.parts.total("real_numel" if fsdp else "local_numel"),
                                    params_bytes=memory.params_bytes, grads_bytes=memory.grads_bytes,
                                    optimizer_bytes=memory.optimizer_bytes, activations_bytes=memory.activations_bytes,
                                    other_bytes=memory.other_bytes, total_bytes=memory.total_bytes,
                                    optimizer_temp_bytes=int(memory.optimizer_temp_bytes),
                                    loss_backward_bytes=int(memory.loss_backward_bytes),
                                    backward_bytes=int(memory.backward_bytes))
