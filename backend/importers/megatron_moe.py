"""Megatron-Core's MoE arguments -> the spec's MoE fields (model.capacity_factor, moe_pad_to_capacity, moe_dispatcher,
moe_grouped_gemm, moe_aux_loss_coeff) and the expert layout (parallel.etp), with Megatron's defaults.

Defaults and rules from NVIDIA/Megatron-LM @ core_v0.19.0 (5be9626709af2722333bf54797c954c09edeada3):
- megatron/training/arguments.py l. 569-570: `--expert-tensor-parallel-size` unset = `--tensor-model-parallel-size`;
  l. 1608-1609: a one-element `--moe-aux-loss-coeff` list is that value;
- megatron/core/transformer/transformer_config.py: moe_token_dispatcher_type "allgather" (l. 862), moe_grouped_gemm
  False (l. 829), moe_aux_loss_coeff 0.0 (l. 846), moe_router_load_balancing_type "aux_loss" (l. 722),
  moe_expert_capacity_factor None = dropless (l. 888) and a negative one is None (l. 1661-1662),
  moe_pad_expert_input_to_capacity needs a capacity factor (l. 1686-1690; the spec's own check says so too).
"""

from __future__ import annotations

from typing import Any

from backend.importers.fields import Flat

MOE_FIELDS = ("top_k", "expert_ffn_hidden", "etp", "capacity_factor", "moe_pad_to_capacity", "moe_grouped_gemm",
              "moe_aux_loss_coeff", "mg_dispatcher", "mg_lb_type")
"""Canonical fields that mean nothing without --num-experts (dropped for a dense model)."""
DISPATCHERS = {"alltoall": "alltoall", "allgather": "allgather", "flex": "flex"}
"""--moe-token-dispatcher-type -> model.moe_dispatcher (flex: DeepEP or HybridEP, --moe-flex-dispatcher-backend; the
prediction does not tell the two apart)."""
AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
"""Load-balancing types whose coefficient adds a loss (router.py); sinkhorn and none add none."""


def capacity(value: Any) -> float | None:
    """--moe-expert-capacity-factor: None (dropless), or a factor; Megatron turns a negative one into None."""
    if value in (None, "None"):
        return None
    try:
        factor = float(value)
    except (TypeError, ValueError):
        raise ValueError("expected a number (a negative one or None = dropless)") from None
    if factor == 0:
        raise ValueError("a capacity factor of 0 lets no token reach an expert: expected a number > 0 (or < 0 / None "
                         "for dropless)")
    return None if factor < 0 else factor


def moe(flat: Flat) -> list[str]:
    """The MoE fields once every argument is read (needs tp and ep); returns notes."""
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
    return _expert_tp(flat) + _dispatcher(flat) + _aux_loss(flat)


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
