"""The parallel dimensions, written once. Each entry (`Dim`) holds its spec field (type, default, bounds, docstring),
its options (cp's K/V rotation, pp's schedule, tp's sequence parallelism), its place on the device mesh or how it
folds into another dimension, whether it multiplies into the world size, its CLI flag, its form widget, its sweep
key and its store / export column.

Everything else derives from `DIMS` through the functions below: `ParallelSpec`'s degree fields (`spec_model`),
the CLI flags (`cli_flags`), sweeps (`world_paths`), the New-experiment form (`form_fields`), the store and the
export (`columns`, `placed_columns`, `not_applicable`), the engine's mesh (`mesh_dims`, `mesh_shape`), the rank
layout (`coords`, `rank_at`), the prediction core's `Layout` and the run rules' `LayoutView` (`degree_names`) and
the planner's degree space (backend/planner/space.py `degree_space`). Each takes a dims tuple, so a test can add a
dimension (tests/unit/test_dims.py). What a dimension does to memory and time is the prediction core's (model
terms, backend/analytic/); how it runs, the engine's (`strategies/parallelize.py`).

Pure Python: imported by the spec, the prediction core and the store, never torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import cache
from typing import Any, Literal

from pydantic import BaseModel, Field, create_model

from backend.spec.choices import CpRotate, Schedule

MAX_WORLD = 1_000_000
"""Largest degree and world size a spec accepts."""


@dataclass(frozen=True, eq=False)
class Widget:
    """How the New-experiment form shows a field (dashboard/pages/new_experiment.py renders it from this)."""

    label: str
    glossary: str | None = None
    """The dashboard glossary's term that explains it (dashboard/glossary.HELP), shown as the widget's help."""
    help: str | None = None
    """Its help in its own words, where the glossary has no term for it."""
    words: Mapping[str, str] = field(default_factory=dict)
    """A choice's value -> what the form shows for it (selectboxes)."""


@dataclass(frozen=True, eq=False)
class SpecField:
    """One field of `ParallelSpec` that belongs to a dimension: its degree or one of its options."""

    name: str
    """The field of `ParallelSpec` (spec JSON key `parallel.<name>`)."""
    annotation: Any
    default: Any
    doc: str
    """The field's docstring (its description in the spec's JSON schema)."""
    ge: int | None = None
    le: int | None = None
    flag: str | None = None
    """The CLI flag of `estimate`, `run`, `submit` (backend/cli/spec_flags.py); its name without dashes is also its
    sweep key (backend/sweep.py), beside the dotted path `parallel.<name>`."""
    flag_kind: Literal["value", "switch", "toggle"] = "value"
    """value: `--cp N`; switch: `--sequence-parallel` sets it; toggle: `--cp-load-balance` / `--no-cp-load-balance`."""
    flag_help: str | None = None
    """The flag's help for switches and toggles (a value flag's help is its spec path)."""
    widget: Widget | None = None
    """None: not on the form (dp is derived from the world size)."""
    column: str | None = None
    """Its store row key and export column; None: its name."""
    column_after: str | None = None
    """The row / CSV column it follows. CSV column order is a contract older than this table: the pipeline schedule,
    the virtual stages and sequence parallelism keep their places; None puts it in the degree block after world_size."""

    @property
    def key(self) -> str:
        """Its store row key and export column."""
        return self.column or self.name

    @property
    def kind(self) -> type:
        """int, bool, str or the StrEnum of its values."""
        base = self.annotation
        return int if base in (int, int | None) else base


@dataclass(frozen=True, eq=False)
class Dim:
    """One parallel dimension: its degree field, its options and where its ranks lie."""

    name: str
    degree: SpecField
    options: tuple[SpecField, ...] = ()
    """Fields that apply only when the degree is > 1 (blank in the export and the Runs table otherwise)."""
    in_world: bool = True
    """Its degree multiplies into world_size (ep does not: its ranks are carved out of others)."""
    rank_order: int | None = None
    """Its place in the row-major rank layout, the last fastest (torchtitan's pp, dp, cp, tp); None when not in the
    world."""
    mesh: str | None = None
    """The named device-mesh dimension its ranks lie along (engine/mesh.py). A dimension folded into another names
    that one: cp -> "dp", whose mesh dimension then holds dp x cp ranks (strategies/cp_layout.py unflattens it into
    (dp_mod_cp, cp))."""
    carved_from: tuple[str, ...] = ()
    """Not in the world: the dimensions whose ranks it is carved out of (ep: the dp x cp ranks sharing parameters,
    strategies/ep_mesh.py unflattens them into (dp_mod_ep, ep)); its coordinate is the index in their flattened
    group modulo its degree."""
    remainder: bool = False
    """The degree a spec derives when unset: the world's ranks that the other in-world degrees leave (dp)."""
    always_named: bool = False
    """Named in a rank's coords and the world arithmetic even at degree 1; a newer dimension is named only above 1,
    so the runs stored before it read the same."""
    pure_strategy: bool = False
    """A headline strategy of this name exists (backend/spec/choices.Strategy): its degree defaults to world_size."""
    changes_world: bool = True
    """A sweep over its degree re-derives dp and the pure strategy's degree (backend/sweep.drop_derived)."""

    @property
    def fields(self) -> tuple[SpecField, ...]:
        return (self.degree, *self.options)


def _degree(name: str, doc: str, *, widget: Widget | None = None, default: Any = 1, annotation: Any = int) -> SpecField:
    """A degree field: an int from 1 to MAX_WORLD, its flag `--<name>`."""
    return SpecField(name, annotation, default, doc, ge=1, le=MAX_WORLD, flag=f"--{name}", widget=widget)


SCHEDULE_WORDS = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "interleaved 1F1B",
                  "zero_bubble": "zero bubble", "zbv": "zero-bubble V"}
CP_ROTATE_WORDS = {"allgather": "all-gather K/V once per attention call (torch's default)",
                   "alltoall": "pass K/V round the ring, one hop per block (overlaps each block)"}

DP = Dim(
    "dp", _degree("dp", "Data-parallel degree (batch split); None derives world_size / (cp * tp * pp).",
                  default=None, annotation=int | None),
    rank_order=1, mesh="dp", remainder=True, always_named=True)
TP = Dim(
    "tp", _degree("tp", "Tensor-parallel degree.",
                  widget=Widget("TP degree", help="Tensor parallel: 1 for the pure tp strategy means tp = world size")),
    options=(
        SpecField("sequence_parallel", bool, False,
                  "Shard norms/dropout activations along the sequence (needs tp > 1).",
                  flag="--sequence-parallel", flag_kind="switch",
                  widget=Widget("Sequence parallel (with TP)", glossary="sequence parallel"),
                  column_after="virtual_stages"),),
    rank_order=3, mesh="tp", always_named=True, pure_strategy=True)
PP = Dim(
    "pp", _degree("pp", "Pipeline-parallel degree (stages = pp * virtual_stages).",
                  widget=Widget("PP degree",
                                help="Pipeline parallel: 1 for the pure pp strategy means pp = world size")),
    options=(
        SpecField("pp_schedule", Schedule, Schedule.ONE_F_ONE_B, "Pipeline schedule (used when pp > 1).",
                  flag="--schedule", widget=Widget("Pipeline schedule", glossary="schedule", words=SCHEDULE_WORDS),
                  column="schedule", column_after="zero_stage"),
        SpecField("virtual_stages", int, 1, "Model chunks per pipeline rank (interleaved schedules need >= 2).",
                  ge=1, le=1024, flag="--virtual-stages",
                  widget=Widget("Virtual stages per rank", glossary="virtual stages"), column_after="microbatches")),
    rank_order=0, mesh="pp", always_named=True, pure_strategy=True)
EP = Dim(
    "ep", _degree("ep", "Expert-parallel degree; experts are split over ep ranks carved out of the dp x cp ranks.",
                  widget=Widget("EP degree", help="Expert parallel: MoE experts split over this many ranks")),
    in_world=False, carved_from=("dp", "cp"), always_named=True, pure_strategy=True)
CP = Dim(
    "cp", _degree("cp", "Context-parallel degree: every sequence is split over cp ranks (ring attention); they "
                  "hold the same\nparameters, so gradients are averaged and FSDP / ZeRO state is sharded over dp x cp "
                  "(torchtitan's dp_shard_cp).", widget=Widget("CP degree", glossary="context parallel")),
    options=(
        SpecField("cp_rotate", CpRotate, CpRotate.ALLGATHER, "How K/V reach the other cp ranks: allgather (once per "
                  "attention call) or alltoall (round the ring).", flag="--cp-rotate",
                  widget=Widget("CP K/V rotation", glossary="cp rotate", words=CP_ROTATE_WORDS)),
        SpecField("cp_load_balance", bool, True, "Causal load balancing: rank i holds sequence chunks i and 2cp-1-i of "
                  "2cp (head-tail, as torchtitan and\nMegatron), so every cp rank does the same attention work; off: "
                  "contiguous chunks (the last rank does most).", flag="--cp-load-balance", flag_kind="toggle",
                  flag_help="spec parallel.cp_load_balance (head-tail sequence chunks; default on)",
                  widget=Widget("CP load balancing (head-tail)", glossary="cp load balance"))),
    rank_order=2, mesh="dp")
ETP = Dim(
    "etp", SpecField("etp", int, 1, "Expert tensor-parallel degree (ep > 1): each routed expert's weights are split "
                     "over etp ranks of the tp group (colwise / rowwise, as the dense MLP over tp), whole at 1; the "
                     "other tp / etp ranks of the group hold the same expert shards (analytic/expert_layout.py). At "
                     "ep = 1 the experts are split over tp like the dense MLP (etp = tp, Megatron's default).",
                     ge=1, le=MAX_WORLD, flag="--etp", column_after="sequence_parallel",
                     widget=Widget("Expert TP degree", help="Expert tensor parallel (with EP): each expert's weights "
                                   "split over this many of the tp ranks; 1 keeps experts whole")),
    in_world=False, carved_from=("tp",), changes_world=False)
"""Carved out of the tp ranks: a rank's etp index is its tp index modulo etp (Megatron-Core's expert grid puts etp
fastest, order tp-ep-dp-pp)."""

DIMS: tuple[Dim, ...] = (DP, TP, PP, EP, CP, ETP)
"""The dimensions in spec, CLI and export order."""


# ---- the spec ------------------------------------------------------------------------------------------------------

def spec_fields(dims: Sequence[Dim]) -> list[SpecField]:
    """Every field of the dimensions, each dimension's degree followed by its options."""
    return [f for d in dims for f in d.fields]


def spec_model(dims: Sequence[Dim], base: type[BaseModel], name: str = "ParallelDegrees") -> type[BaseModel]:
    """A pydantic model with `base`'s fields, then the dimensions' (bounds, defaults and docstrings in its schema)."""
    fields = {f.name: (f.annotation, Field(f.default, ge=f.ge, le=f.le, description=f.doc)) for f in spec_fields(dims)}
    return create_model(name, __base__=base, __module__=base.__module__, **fields)


def degree_names(dims: Sequence[Dim]) -> tuple[str, ...]:
    return tuple(d.name for d in dims)


def world_dims(dims: Sequence[Dim]) -> tuple[Dim, ...]:
    """The dimensions whose degrees multiply into world_size, in rank-layout order (the first slowest)."""
    return _world_dims(tuple(dims))


@cache
def _world_dims(dims: tuple[Dim, ...]) -> tuple[Dim, ...]:
    return tuple(sorted((d for d in dims if d.in_world), key=lambda d: d.rank_order))


def pure_strategies(dims: Sequence[Dim]) -> tuple[str, ...]:
    """The degrees a headline strategy of the same name sets to the world size (tp, pp, ep)."""
    return tuple(d.name for d in dims if d.pure_strategy)


def remainder(dims: Sequence[Dim]) -> Dim:
    (dim,) = [d for d in dims if d.remainder]
    return dim


# ---- the rank layout and the mesh ---------------------------------------------------------------------------------

def coords(dims: Sequence[Dim], degrees: Mapping[str, int], rank: int) -> dict[str, int]:
    """Mesh coordinates of a global rank: the in-world dimensions row-major in rank order (tp fastest), then each
    carved dimension's index; a dimension not `always_named` only when its degree is > 1."""
    world, carved = _rank_layout(tuple(dims))
    index, stride = {}, 1
    for name, _ in reversed(world):
        index[name] = (rank // stride) % degrees[name]
        stride *= degrees[name]
    out = {name: index[name] for name, always in world if always or degrees[name] > 1}
    for name, within, always in carved:
        if not (always or degrees[name] > 1):
            continue
        flat = 0
        for n in within:
            flat = flat * degrees[n] + index[n]
        out[name] = flat % degrees[name]
    return out


@cache
def _rank_layout(dims: tuple[Dim, ...]) -> tuple[tuple[tuple[str, bool], ...],
                                                 tuple[tuple[str, tuple[str, ...], bool], ...]]:
    """((in-world name, always named) in rank order, (carved name, the names it is carved from in rank order, always
    named))."""
    world = world_dims(dims)
    return (tuple((d.name, d.always_named) for d in world),
            tuple((d.name, tuple(w.name for w in world if w.name in d.carved_from), d.always_named)
                  for d in dims if not d.in_world))


def rank_at(dims: Sequence[Dim], degrees: Mapping[str, int], at: Mapping[str, int]) -> int:
    """The global rank at these coordinates of the in-world dimensions (0 where not given): inverse of `coords`."""
    unknown = set(at) - {d.name for d in world_dims(dims)}
    if unknown:
        raise TypeError(f"rank_at takes the in-world dimensions' coordinates, not {sorted(unknown)}")
    rank = 0
    for d in world_dims(dims):
        rank = rank * degrees[d.name] + at.get(d.name, 0)
    return rank


def mesh_dims(dims: Sequence[Dim]) -> tuple[str, ...]:
    """The named dimensions of the device mesh, in rank order: (pp, dp, tp)."""
    return tuple(dict.fromkeys(d.mesh for d in world_dims(dims)))


def mesh_shape(dims: Sequence[Dim], degrees: Mapping[str, int]) -> tuple[int, ...]:
    """The size of each mesh dimension: the product of the degrees folded into it ((pp, dp x cp, tp))."""
    return tuple(math.prod(degrees[d.name] for d in world_dims(dims) if d.mesh == m) for m in mesh_dims(dims))


# ---- the CLI, sweeps and the form ---------------------------------------------------------------------------------

def cli_flags(dims: Sequence[Dim]) -> dict[str, SpecField]:
    """flag -> its field, for every field with a flag (value flags, switches and toggles)."""
    return {f.flag: f for f in spec_fields(dims) if f.flag}


def flag_choices(f: SpecField) -> Any:
    """A value flag's argparse type: int, or the list of its enum's values."""
    return [v.value for v in f.kind] if isinstance(f.kind, type) and issubclass(f.kind, StrEnum) else f.kind


def world_paths(dims: Sequence[Dim]) -> set[str]:
    """Sweep paths that change the world: the degrees, world_size and the strategy."""
    return {"parallel.world_size", "parallel.strategy"} | {f"parallel.{d.name}" for d in dims if d.changes_world}


def form_fields(dims: Sequence[Dim]) -> list[SpecField]:
    """The fields the New-experiment form shows: the degrees first (one row), then each dimension's options."""
    return [d.degree for d in dims if d.degree.widget] + [f for d in dims for f in d.options if f.widget]


# ---- the store and the export -------------------------------------------------------------------------------------

def columns(dims: Sequence[Dim]) -> list[SpecField]:
    """Every field with its store / export column, in table order."""
    return spec_fields(dims)


def placed_columns(base: Sequence[str], dims: Sequence[Dim], *, after: str = "world_size") -> list[str]:
    """`base` with the dimensions' columns: the degree block (each degree, then its unplaced options) after `after`,
    the others after the column each names (`SpecField.column_after`)."""
    out = list(base)
    at = out.index(after) + 1
    out[at:at] = [f.key for f in spec_fields(dims) if f.column_after is None]
    pending = [f for f in spec_fields(dims) if f.column_after is not None]
    while pending:
        placeable = [f for f in pending if f.column_after in out]
        if not placeable:
            raise ValueError(f"no column {pending[0].column_after!r} to place {pending[0].key!r} after")
        for f in placeable:
            out.insert(out.index(f.column_after) + 1, f.key)
        pending = [f for f in pending if f not in placeable]
    return out


def not_applicable(dims: Sequence[Dim]) -> dict[str, str]:
    """option column -> its dimension's degree column: the option is blank unless that degree is > 1."""
    return {f.key: d.degree.key for d in dims for f in d.options}


def unnamed_parts(dims: Sequence[Dim], degrees: Mapping[str, int], named: Iterable[str]) -> list[str]:
    """"xp2" for each dimension above 1 that a hand-written label does not name itself (so a new one still shows)."""
    named = set(named)
    return [f"{d.name}{degrees[d.name]}" for d in dims if d.name not in named and degrees[d.name] > 1]
