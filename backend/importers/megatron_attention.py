"""Megatron-LM's attention-shape arguments -> the spec: multi-latent attention (DeepSeek-V2/V3), a head width of its
own (--kv-channels, Qwen3) and per-head q / k norms (--qk-layernorm).

From NVIDIA/Megatron-LM @ core_v0.19.0: megatron/core/transformer/transformer_config.py MLATransformerConfig
(multi_latent_attention False, q_lora_rank None = q projected directly, kv_lora_rank 32, qk_head_dim 128 = the per-head
width without rotary position, qk_pos_emb_head_dim 64 = the rotary width, v_head_dim 128); the MLA attention
(multi_latent_attention.py) sizes its projections from those and never reads kv_channels; TransformerConfig
kv_channels (None = hidden / heads) is the q / k / v head width of ordinary attention; qk_layernorm norms q and k per
head (with MLA: the q and kv latents, which the spec's MLA counts already).
"""

from __future__ import annotations

from typing import Any

from backend.importers.fields import Flat, Ignore, To, flag
from backend.importers.megatron_moe import count_or_none

MLA_DEFAULTS = {"kv_lora_rank": 32, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
"""MLATransformerConfig's defaults for what the arguments leave unset (q_lora_rank: None)."""
MLA_ARGS = {"q_lora_rank": "--q-lora-rank", "kv_lora_rank": "--kv-lora-rank", "qk_nope_head_dim": "--qk-head-dim",
            "qk_rope_head_dim": "--qk-pos-emb-head-dim", "v_head_dim": "--v-head-dim"}
_YARN = "YaRN's attention scaling for long contexts: numerics only"

TABLE: dict[str, Any] = {
    "--multi-latent-attention": To("mg_mla", lambda v: v is True or flag(v)),
    **{arg: To(f"mg_{name}", count_or_none) for name, arg in MLA_ARGS.items()},
    "--qk-layernorm": To("mg_qk_norm", lambda v: v is True or flag(v)),
    "--kv-channels": To("mg_kv_channels", count_or_none),
    "--mscale": Ignore(_YARN), "--mscale-all-dim": Ignore(_YARN),
}
"""Merged into megatron_fields.TABLE."""


def attention_shape(flat: Flat, hidden: int, heads: int) -> list[str]:
    """MLA's widths, or the head width and q / k norms of ordinary attention; returns notes."""
    names = ("mla", "qk_norm", "kv_channels", *MLA_ARGS)
    source = {name: flat.source_of(f"mg_{name}") for name in names}  # the config's own key (NeMo: model.<name>)
    given = {name: flat.canonical.pop(f"mg_{name}", (None, ""))[0] for name in names}
    if not given["mla"]:
        for name in MLA_ARGS:
            if given[name] is not None:
                flat.ignore(source[name], given[name], "read only with multi-latent attention: unset here")
        if given["kv_channels"] is not None and given["kv_channels"] != hidden // heads:
            flat.put("attn_head_dim", given["kv_channels"], source["kv_channels"])
        if given["qk_norm"]:
            flat.put("qk_norm", True, source["qk_norm"])
        return []
    notes = []
    for name, arg in MLA_ARGS.items():
        value = given[name] if given[name] is not None else MLA_DEFAULTS.get(name)
        if value is not None:
            flat.put(name, value, source[name] if given[name] is not None else arg)
        if given[name] is None and name in MLA_DEFAULTS:
            notes.append(f"MLA {arg} not given: Megatron's default {value} (MLATransformerConfig)")
    if given["kv_channels"] is not None:
        flat.ignore(source["kv_channels"], given["kv_channels"], "multi-latent attention sizes its heads by "
                    "--qk-head-dim, --qk-pos-emb-head-dim and --v-head-dim: kv_channels is not read")
    if given["qk_norm"]:
        flat.ignore(source["qk_norm"], True, "with multi-latent attention it norms the q / kv latents, which the "
                    "spec's MLA already counts")
    return notes
