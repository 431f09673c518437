"""Megatron-Core's MoE arguments -> the spec's MoE fields (model.capacity_factor, moe_pad_to_capacity, moe_dispatcher,
moe_grouped_gemm, moe_aux_loss_coeff) and the expert layout (parallel.etp), with Megatron's defaults.

Defaults and rules from NVIDIA/Megatron-LM @ core_v0.19.0 (5be9626709af2722333bf54797c954c09edeada3):
- megatron/training/arguments.py l. 569-570: `--expert-tensor-parallel-size` unset = `--tensor-model-parallel-size`;
  l. 1608-1609: a one-element `--moe-aux-loss-coeff` list is that value;
- megatron/core/transformer/transformer_config.py: moe_token_dispatcher_type "allgather" (l. 862), moe_grouped_gemm
  False (l. 829), moe_aux_loss_coeff 0.0 (l. 846), moe_router_load_balancing_type "aux_loss" (l. 722),
  moe_expert_capacity_factor None = dropless (l. 888) and a negative one is None (l. 1661-1662),
  moe_pad_expert_input_to_capacity needs a capacity factor (l. 1686-1690; the spec's own check says so too);
- megatron/training/arguments.py `moe_freq_type`: --moe-layer-freq is an integer N (one MoE layer in N, at the layers
  i % N == 0: models/gpt/gpt_layer_specs.py get_gpt_decoder_block_spec) or a Python list expression of 0 / 1 per
  layer ("([0]*3+[1]*58)": DeepSeek-V3's three dense layers first), read here without evaluating it;
- the router: --moe-router-score-function softmax | sigmoid, --moe-router-enable-expert-bias (the aux-loss-free
  expert bias), --moe-router-num-groups / --moe-router-group-topk (group-limited routing);
- --mtp-num-layers: DeepSeek-V3's multi-token-prediction layers, each one more transformer block trained on the last
  pipeline stage (multi_token_prediction.py): not modelled, reported.
"""

from __future__ import annotations

import ast
from typing import Any

from backend.importers.fields import Flat, To, choice, flag

MOE_FIELDS = ("top_k", "expert_ffn_hidden", "etp", "capacity_factor", "moe_pad_to_capacity", "moe_grouped_gemm",
              "moe_aux_loss_coeff", "mg_dispatcher", "mg_lb_type", "router_score", "router_balance_bias",
              "expert_groups", "topk_groups", "mg_layer_freq")
"""Canonical fields that mean nothing without --num-experts (dropped for a dense model)."""
DISPATCHERS = {"alltoall": "alltoall", "allgather": "allgather", "flex": "flex"}
"""--moe-token-dispatcher-type -> model.moe_dispatcher (flex: DeepEP or HybridEP, --moe-flex-dispatcher-backend; the
prediction does not tell the two apart)."""
AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
"""Load-balancing types whose coefficient adds a loss (router.py); sinkhorn and none add none."""


PATTERN_WORDS = ("expected an integer or a list expression of 0 / 1 per layer built with [ ], + and *, e.g. "
                 "([0]*3+[1]*58)")
MAX_PATTERN = 100_000
"""Entries a --moe-layer-freq list expression may expand to (a real one has one per layer)."""


def count_or_none(value: Any) -> int | None:
    """An integer >= 1, or None (unset, or printed as None)."""
    if value in (None, "None"):
        return None
    try:
        n = int(str(value)) if not isinstance(value, bool) else 0
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError("expected an integer >= 1 (or None)")
    return n


def layer_count(value: Any) -> int:
    """An integer >= 0 (--mtp-num-layers: 0 or None = none)."""
    if value in (None, "None"):
        return 0
    try:
        n = int(str(value)) if not isinstance(value, bool) else -1
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError("expected an integer >= 0")
    return n


TABLE = {
    "--moe-router-score-function": To("router_score", choice({"softmax": "softmax", "sigmoid": "sigmoid"})),
    "--moe-router-enable-expert-bias": To("router_balance_bias", lambda v: v is True or flag(v)),
    "--moe-router-num-groups": To("expert_groups", count_or_none),
    "--moe-router-group-topk": To("topk_groups", count_or_none),
    "--moe-layer-freq": To("mg_layer_freq"),
    "--mtp-num-layers": To("mg_mtp_layers", layer_count),
}
"""The MoE router, the MoE layer pattern and the MTP layers (merged into megatron_fields.TABLE)."""


def capacity(value: Any) -> float | None:
    """--moe-expert-capacity-factor: None (dropless), or a factor; Megatron turns a negative one into None."""
    if value in (None, "None"):
        return None
    try:
        if isinstance(value, bool):  # a flag given bare (megatron_args._flags): float(True) would be 1.0
            raise TypeError
        factor = float(value)
    except (TypeError, ValueError):
        raise ValueError("expected a number (a negative one or None = dropless)") from None
    if factor == 0:
        raise ValueError("a capacity factor of 0 lets no token reach an expert: expected a number > 0 (or < 0 / None "
                         "for dropless)")
    return None if factor < 0 else factor


def moe(flat: Flat) -> list[str]:
    """The MoE fields once every argument is read (needs tp and ep); returns notes."""
    mtp(flat)
    if not flat.get("n_experts"):
        for name in ("n_experts", *MOE_FIELDS):
            flat.canonical.pop(name, None)
        return []
    if flat.get("expert_ffn_hidden") is None:
        flat.canonical.pop("expert_ffn_hidden", None)
    if flat.get("mg_shared_ffn") is not None:
        flat.put("n_shared_experts", 1, flat.source_of("mg_shared_ffn"))
        flat.put("shared_ffn_hidden", flat.get("mg_shared_ffn"), flat.source_of("mg_shared_ffn"))
    if flat.get("capacity_factor") is None:
        flat.canonical.pop("capacity_factor", None)
    for name in ("expert_groups", "topk_groups"):
        if flat.get(name) is None:
            flat.canonical.pop(name, None)
    return _expert_tp(flat) + _dispatcher(flat) + _aux_loss(flat) + _layer_pattern(flat)


def mtp(flat: Flat) -> None:
    """--mtp-num-layers > 0: reported (ShardLab trains the next-token objective only)."""
    layers, source = flat.get("mg_mtp_layers", 0), flat.source_of("mg_mtp_layers")
    flat.canonical.pop("mg_mtp_layers", None)
    if layers:
        flat.unmap(source, layers, f"{layers} multi-token-prediction layer(s), each one more transformer "
                   "block (with its projection and norms) and one more lm_head pass on the last pipeline stage: not "
                   "modelled, predicted without them")


def parse_pattern(value: Any) -> int | list[int]:
    """--moe-layer-freq as Megatron's moe_freq_type reads it, without eval: an integer, or a list expression of
    0 / 1 entries built from list literals, + and * (ValueError otherwise)."""
    if isinstance(value, (int, list)) and not isinstance(value, bool):
        out = value
    else:
        try:
            out = _pattern(ast.parse(str(value).strip(), mode="eval").body)
        except SyntaxError:
            raise ValueError(PATTERN_WORDS) from None
    if isinstance(out, list) and any(x not in (0, 1) for x in out):
        raise ValueError("expected a list of 0 (dense) and 1 (MoE) per layer")
    if isinstance(out, int) and out < 1:
        raise ValueError("expected an integer >= 1 (one MoE layer in N)")
    return out


def _pattern(node: ast.AST) -> int | list[int]:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_entry(_pattern(e)) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern(node.left), _pattern(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
            items, times = (left, right) if isinstance(left, list) else (right, left)
            if times < 0 or len(items) * times > MAX_PATTERN:
                raise ValueError(f"the list expression expands to more than {MAX_PATTERN:,} entries")
            return items * times
    raise ValueError(PATTERN_WORDS)


def _entry(x: int | list[int]) -> int:
    if isinstance(x, list):
        raise ValueError("expected a flat list of 0 / 1 per layer")
    return x


def _layer_pattern(flat: Flat) -> list[str]:
    """--moe-layer-freq -> model.first_dense_layers and model.moe_every (block i MoE when i >= first_dense_layers and
    (i + 1) % moe_every == 0); a pattern they cannot express is reported."""
    given, source = flat.get("mg_layer_freq"), flat.source_of("mg_layer_freq")
    flat.canonical.pop("mg_layer_freq", None)
    if given is None:
        return []
    layers = flat.get("n_layers")
    try:
        freq = parse_pattern(given)
    except ValueError as e:
        flat.problems.append(f"{source}={given!r}: {e}")
        return []
    pattern = [1 if i % freq == 0 else 0 for i in range(layers)] if isinstance(freq, int) else freq
    if len(pattern) != layers:
        flat.problems.append(f"{source}={given!r} has {len(pattern)} entries != {flat.source_of('n_layers')} "
                             f"{layers} (Megatron asserts one per layer)")
        return []
    fit = dense_prefix_and_interleave(pattern)
    if fit is not None:
        if fit != (0, 1):
            flat.put("first_dense_layers", fit[0], source)
            flat.put("moe_every", fit[1], source)
        return []
    moe_layers = sum(pattern)
    if isinstance(freq, int):  # MoE at 0, N, 2N, ...: ShardLab's interleave puts it at N-1, 2N-1, ...
        flat.put("moe_every", freq, source)
        flat.unmap(source, given, f"MoE at layers 0, {freq}, {2 * freq}, ... ({moe_layers} of {layers}); predicted "
                   f"with moe_every {freq} (layers {freq - 1}, {2 * freq - 1}, ...: "
                   f"{sum(1 for i in range(layers) if (i + 1) % freq == 0)} MoE layers, each pipeline stage's "
                   "share may differ)")
        return []
    flat.unmap(source, given, f"a MoE pattern ({moe_layers} of {layers} layers) that no dense prefix + every-k-th "
               "interleave expresses: predicted with MoE on every layer")
    return []


def dense_prefix_and_interleave(pattern: list[int]) -> tuple[int, int] | None:
    """(first_dense_layers, moe_every) whose layer pattern equals `pattern` (0 dense, 1 MoE): the smallest moe_every,
    then the shortest dense prefix; None when there is none (or no MoE layer at all)."""
    if 1 not in pattern:
        return None
    first = pattern.index(1)
    for every in range(1, len(pattern) + 1):
        if all(pattern[i] == (1 if (i + 1) % every == 0 else 0) for i in range(first, len(pattern))):
            return max((i + 1 for i in range(first) if (i + 1) % every == 0), default=0), every
    return None


def _expert_tp(flat: Flat) -> list[str]:
    """etp unset = tp (Megatron). At ep 1 the spec splits the experts over tp like the dense MLP (etp = tp): an etp
    other than tp there is reported."""
    tp, ep, etp = flat.get("tp", 1), flat.get("ep", 1), flat.get("etp")
    flat.canonical.pop("etp", None)
    if ep == 1:
        if etp is not None and etp != tp:
            flat.unmap("--expert-tensor-parallel-size", etp, f"at ep 1 ShardLab splits the experts over tp like the "
                       f"dense MLP (etp = tp = {tp}): predicted so")
        return []
    if etp is None:
        flat.put("etp", tp, "--tensor-model-parallel-size")
        return [f"expert tensor parallel {tp}: --expert-tensor-parallel-size not given, Megatron's default is "
                "--tensor-model-parallel-size (arguments.py l. 569-570 @ core_v0.19.0)"] if tp > 1 else []
    flat.put("etp", etp, "--expert-tensor-parallel-size")
    return []


def _dispatcher(flat: Flat) -> list[str]:
    """--moe-token-dispatcher-type (Megatron's default allgather): alltoall / allgather / flex map, any other value is
    a problem."""
    given = flat.get("mg_dispatcher")
    kind = str(given if given is not None else "allgather").lower()
    if flat.get("ep", 1) == 1:
        return []
    if kind not in DISPATCHERS:
        flat.problems.append(f"--moe-token-dispatcher-type={given!r}: expected one of allgather, alltoall, flex")
        return []
    flat.put("moe_dispatcher", DISPATCHERS[kind], "--moe-token-dispatcher-type")
    if given is None:
        return ["token dispatcher allgather: --moe-token-dispatcher-type not given, Megatron's default "
                "(transformer_config.py l. 862 @ core_v0.19.0)"]
    return []


def _aux_loss(flat: Flat) -> list[str]:
    """--moe-aux-loss-coeff (one value, or a list with one per --moe-router-load-balancing-type)."""
    coeff, kinds = flat.get("moe_aux_loss_coeff"), flat.get("mg_lb_type", "aux_loss")
    flat.canonical.pop("moe_aux_loss_coeff", None)
    coeffs = coeff if isinstance(coeff, list) else [coeff]
    kinds = kinds if isinstance(kinds, list) else [kinds]
    if coeff is None:
        return []
    try:
        values = [float(c) for c in coeffs]
    except (TypeError, ValueError):
        flat.problems.append(f"--moe-aux-loss-coeff={coeff!r}: expected a number (or one per load-balancing type)")
        return []
    losses = [(k, c) for k, c in zip(kinds, values, strict=False) if k in AUX_LOSS_TYPES
              and c > 0] if len(kinds) == len(values) \
        else [(kinds[0], v) for v in values]
    if len(losses) > 1:
        flat.unmap("--moe-aux-loss-coeff", coeff, f"several load-balancing losses ({kinds}): predicted as one "
                   f"Switch-style aux loss with coefficient {losses[0][1]}")
    if not losses:
        if any(values) and kinds[0] not in AUX_LOSS_TYPES:
            return [f"--moe-aux-loss-coeff {coeff}: no aux loss under --moe-router-load-balancing-type {kinds[0]}"]
        return []
    kind, value = losses[0]
    flat.put("moe_aux_loss_coeff", value, "--moe-aux-loss-coeff")
    if kind != "aux_loss":
        return [f"load balancing {kind}: predicted as the Switch-style aux_loss (the same few E-sized reductions per "
                "MoE layer)"]
    return []
