"""What a framework's configuration field becomes: the tables every importer is written as.

A config is first flattened to {source key: value} ("parallelism.tensor_parallel_degree", "--num-layers",
"model.tensor_model_parallel_size", "zero_optimization.stage"). Each format's table says, per source key, one of:
- `To(name, convert)`: a *canonical* field (tp, micro_batch, d_model, recompute, cp, ...) with its converter;
- `Ignore(reason)`: known, and changes nothing ShardLab predicts (learning rate, data paths, logging, ...);
- `Unmappable(reason)`: changes memory or time, but no spec field expresses it (reported, never dropped).
A key in no table is reported as unknown: ShardLab cannot tell whether it changes memory or time.

Canonical fields then reach the spec through ONE table, `SPEC_FIELDS` (canonical name -> spec path, or `Pending`:
the spec has no such field yet). Wiring a new spec field later is a one-line change there: replace the `Pending(...)`
by the spec path. Context parallelism (cp, cp_rotate), fp8 (precision fp8, fp8_recipe, fp8_all_gather) and the
activation-checkpointing policies (recompute op / layers:K / block:N / uniform:N) are spec fields now: each
framework's rules write them as canonical cp / cp_rotate / precision / fp8_recipe / recompute. The stack and its
settings (spec/stacks.py: attention_kernel, elementwise, the dtypes, loss_parallel, the overlaps) are canonical
fields of the same names: an importer sets `stack` and every setting its config states.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backend.spec.stacks import SETTINGS as STACK_SETTINGS


@dataclass(frozen=True)
class To:
    name: str
    convert: Callable[[Any], Any] | None = None
    """Raises ValueError naming what it expected; None keeps the value."""


@dataclass(frozen=True)
class Ignore:
    reason: str


@dataclass(frozen=True)
class Unmappable:
    reason: str


@dataclass(frozen=True)
class Pending:
    """A canonical field this base's spec cannot hold yet: reported in `unmapped` with the feature it waits for,
    unless the config holds the value that means "off" (`off`)."""

    feature: str
    target: str
    """Where it will go ("parallel.cp"): the one line to change when the feature lands."""
    off: tuple[Any, ...] = (None, False, 1, "none")

    def is_off(self, value: Any) -> bool:
        """Equal to an `off` value of the same type (True is not 1 here)."""
        return any(value is o or (type(value) is type(o) and value == o) for o in self.off)


Mapper = To | Ignore | Unmappable


# Canonical field -> spec path ("section.field") or Pending. Model fields are "model.<ModelSpec field>".
MODEL_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "seq_len", "n_experts",
                "top_k", "expert_ffn_hidden", "n_shared_experts", "shared_ffn_hidden", "shared_expert_gate", "norm",
                "mlp", "positions", "tie_embeddings", "bias", "attention", "capacity_factor", "moe_pad_to_capacity",
                "moe_dispatcher", "moe_grouped_gemm", "moe_aux_loss_coeff", "router_score", "router_balance_bias",
                "expert_groups", "topk_groups", "first_dense_layers", "moe_every", "attn_head_dim", "qk_norm",
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
SPEC_FIELDS: dict[str, str | Pending] = {
    **{f: f"model.{f}" for f in MODEL_FIELDS},
    "global_batch": "train.global_batch",
    "micro_batch": "train.micro_batch",
    "precision": "train.precision",
    "optimizer": "train.optimizer",
    "recompute": "train.recompute",
    "recompute_modules": "train.recompute_modules",
    "tp": "parallel.tp",
    "pp": "parallel.pp",
    "ep": "parallel.ep",
    "etp": "parallel.etp",
    "sequence_parallel": "parallel.sequence_parallel",
    "pp_schedule": "parallel.pp_schedule",
    "virtual_stages": "parallel.virtual_stages",
    "offload": "parallel.offload",
    "fp8_recipe": "train.fp8_recipe",
    "fp8_all_gather": "train.fp8_all_gather",
    "cp": "parallel.cp",
    "cp_rotate": "parallel.cp_rotate",
    **{f: f"train.{f}" for f in ("stack", *STACK_SETTINGS)},
}
"""The ONE table from canonical fields to the spec. The degree and batch arithmetic (importers/assemble.py) reads
tp, pp, cp, ep and the dp degrees itself, so a Pending degree still counts in `tp x pp x cp x dp = GPUs`."""


@dataclass
class Flat:
    """A config flattened to {source key: value}, and what the importer made of each key."""

    values: dict[str, Any]
    canonical: dict[str, tuple[Any, str]] = field(default_factory=dict)
    """canonical name -> (value, the source key it came from)."""
    ignored: dict[str, dict[str, Any]] = field(default_factory=dict)
    unmapped: dict[str, dict[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    needs: set[str] = field(default_factory=set)
    """What the person importing could supply to clear a problem (imported.VOCAB_SIZE)."""

    def get(self, name: str, default: Any = None) -> Any:
        return self.canonical[name][0] if name in self.canonical else default

    def source_of(self, name: str) -> str:
        return self.canonical[name][1] if name in self.canonical else name

    def put(self, name: str, value: Any, source: str) -> None:
        self.canonical[name] = (value, source)

    def unmap(self, key: str, value: Any, reason: str, **extra: Any) -> None:
        self.unmapped[key] = {"value": value, "reason": reason, **extra}

    def ignore(self, key: str, value: Any, reason: str) -> None:
        self.ignored[key] = {"value": value, "reason": reason}


MAX_NODES = 200_000
"""Values a config may hold once YAML aliases are expanded (a real one holds a few thousand)."""


def check_nodes(data: Any, what: str) -> None:
    """ValueError when `data` holds more than MAX_NODES values: YAML anchors can make a 1 KB file expand to 2^30 of
    them ("billion laughs"), which any walk over it would take forever to visit."""
    count, stack = 0, [data]
    while stack:
        item = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise ValueError(f"{what} expands to more than {MAX_NODES:,} values (YAML aliases?): not a config")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def flatten(data: dict[str, Any], prefix: str = "", *, keep: tuple[str, ...] = ()) -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists stay values; dotted keys listed in `keep` stay whole (a sub-table that
    one mapper reads as a unit)."""
    out: dict[str, Any] = {}
    stack = [(prefix, data)]
    while stack:
        base, node = stack.pop()
        for k, v in node.items():
            key = f"{base}.{k}" if base else str(k)
            if isinstance(v, dict) and v and key not in keep:
                stack.append((key, v))
            else:
                out[key] = v
    return out


def apply_table(flat: Flat, table: dict[str, Mapper], *, prefixes: dict[str, Mapper] | None = None,
                unknown_reason: str = "not known to this importer: ShardLab cannot tell whether it changes memory or "
                                      "step time, so it is reported rather than guessed") -> None:
    """Run every source key through `table` (exact key) or `prefixes` (longest matching key prefix)."""
    ordered = sorted((prefixes or {}).items(), key=lambda kv: -len(kv[0]))
    for key, value in flat.values.items():
        mapper = _mapper(key, table, ordered)
        if mapper is None:
            flat.unmap(key, value, unknown_reason)
        elif isinstance(mapper, Ignore):
            flat.ignore(key, value, mapper.reason)
        elif isinstance(mapper, Unmappable):
            if value in (None, False, "", [], {}, "None"):
                flat.ignore(key, value, "unset or off: nothing to map")
            else:
                flat.unmap(key, value, mapper.reason)
        else:
            try:
                flat.put(mapper.name, mapper.convert(value) if mapper.convert else value, key)
            except ValueError as e:
                flat.problems.append(f"{key}={value!r}: {e}")


def mapper_for(key: str, table: dict[str, Mapper], prefixes: dict[str, Mapper] | None = None) -> Mapper | None:
    """What `apply_table` does with `key`: its exact entry, else its longest matching prefix's, else None."""
    return _mapper(key, table, sorted((prefixes or {}).items(), key=lambda kv: -len(kv[0])))


def _mapper(key: str, table: dict[str, Mapper], ordered: list[tuple[str, Mapper]]) -> Mapper | None:
    return table.get(key) or next((m for p, m in ordered if _under(key, p)), None)


def _under(key: str, prefix: str) -> bool:
    """`key` is `prefix` or inside it: "a.b" under "a", "--log-interval" under "--log", anything under "--adam-"."""
    if key == prefix:
        return True
    if prefix.endswith(("-", "_", ".")):
        return key.startswith(prefix)
    return key.startswith(prefix) and key[len(prefix)] in ".-_"


# ---- converters (ValueError names what was expected) ---------------------------------------------------------

def positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("expected an integer >= 1")
    return value


def degree(value: Any) -> int:
    """A parallel degree: an integer >= 1, or -1 / "auto" (resolved from the GPU count: importers/assemble.py)."""
    if value in (-1, "auto"):
        return -1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError('expected an integer >= 1, or -1 / "auto" (the rest of the GPUs)')
    return value


def flag(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError("expected true or false")


def choice(mapping: dict[Any, Any]) -> Callable[[Any], Any]:
    """A converter from the framework's words to ours (case-insensitive for text)."""
    def convert(value: Any) -> Any:
        key = value.lower() if isinstance(value, str) else value
        if isinstance(key, (list, dict)) or key not in mapping:  # a flag given twice or with several values
            raise ValueError(f"expected one of {', '.join(map(str, mapping))}")
        return mapping[key]
    return convert
