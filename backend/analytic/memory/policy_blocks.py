"""How a rank's blocks fall under its recompute policy: `checkpointing` counts the checkpoint units, the plain
blocks and the span re-run first in backward; `policy_blocks` prices them, each block at its own MLP kind in a stack
that mixes dense and MoE blocks (DeepSeek's dense prefix, Llama 4's and Qwen3-MoE's interleaving: parts.ALT_PART).

The policy (recompute_policy.groups) decides block by block, so a block's kind follows its layer index: layers:2 over
an interleaved stack checkpoints exactly its MoE blocks, and full recompute re-runs the rank's last block, a dense
block only when the stack ends dense. Which blocks are plain, which span re-runs first in backward (the last chunk's
last checkpoint), which plain blocks follow it and, under uniform:N, which full group re-runs before it, are counted
per kind (`policy_kind_counts`). A uniform stack gets the same terms from block 0's kind alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from backend.analytic.layout import RECOMPUTE_NAMES, Layout, RecomputeMode
from backend.analytic.memory.parts import RankParts, alt_layers, is_mixed
from backend.analytic.params import ModelKey, model_key
from backend.analytic.scalar_or_array import ceil_div, logical_or, maximum, minimum, per_distinct, where
from backend.analytic.sharding import layer_split, stages_of_rank
from backend.recompute_policy import groups

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec


@dataclass(frozen=True)
class Checkpointing:
    """How a pipeline rank's blocks fall under the recompute policy (scalars or arrays): `units` checkpoints (a block,
    or a uniform group) and `plain` blocks outside any; in backward the last chunk's last checkpoint re-runs first,
    after `after` plain blocks have freed theirs, re-materialising `rerun_blocks` blocks at once. Chunks of one rank
    hold q or q+1 blocks (q = n_layers // n_stages); the extra layers sit on the earliest stages, so its last chunk
    holds q+1 only when all do."""
    units: Num
    plain: Num
    after: Num
    rerun_blocks: Num


def checkpointing(model: ModelSpec, layout: Layout, n_blocks: Num) -> Checkpointing:
    """The policy's counts on a rank holding n_blocks over layout.virtual_stages chunks
    (models/checkpointing.groups)."""
    v, k, kind = layout.virtual_stages, maximum(layout.recompute_layers, 1), layout.recompute
    q = model.n_layers // layout.n_stages
    big = n_blocks - v * q
    small = v - big
    last = q + (big == v)
    per_block = logical_or(kind == RecomputeMode.FULL, kind == RecomputeMode.OP)
    units = where(per_block, n_blocks, 0)
    units = where(kind == RecomputeMode.LAYERS, big * ((q + 1) // k) + small * (q // k), units)
    units = where(kind == RecomputeMode.BLOCK, big * minimum(k, q + 1) + small * minimum(k, q), units)
    groups = big * ceil_div(q + 1, k) + small * ceil_div(q, k)
    units = where(kind == RecomputeMode.UNIFORM, groups, units)
    plain = where(kind == RecomputeMode.UNIFORM, 0, n_blocks - units)
    after = where(kind == RecomputeMode.LAYERS, where(last >= k, last % k, last), 0)
    after = where(kind == RecomputeMode.BLOCK, last - minimum(k, last), after)
    rerun_blocks = where(kind == RecomputeMode.UNIFORM, last - k * (ceil_div(last, k) - 1), 1)
    return Checkpointing(units, plain, after, rerun_blocks)



@dataclass(frozen=True)
class KindBytes:
    """One block kind's saved bytes (scalars or arrays): plain (outside any checkpoint), a checkpoint unit's, with
    nothing recomputed (while it re-runs), and its 16-bit weight and bias copies under autocast."""
    plain: Num
    unit: Num
    none: Num
    weight_casts: Num
    bias_casts: Num
    rerun_transient: Num = 0.0
    """What a re-run of the kind holds beyond its saved tensors when it peaks: an MoE block's dense dispatch
    accumulates its experts' rows into a (tokens, h) output while the last expert runs (gpt.MoE; 0 otherwise)."""


@dataclass(frozen=True)
class PolicyBlocks:
    """What rank_activations reads of the rank's blocks: `blocks` one microbatch's saved bytes of them all; the first
    re-run span's bytes with nothing recomputed (`rerun_none`), its checkpoint's (`rerun_unit`) and its casts; the plain
    blocks after it (`after_plain`, `after_casts`); the plain blocks' weight casts (`kept_weight_casts`: the share of
    the rank's weight casts they hold); uniform:N's earlier full group (`group_none`, `group_casts`); what the span's
    last block holds beyond its saved tensors while it re-runs (`rerun_transient`)."""
    blocks: Num
    rerun_none: Num
    rerun_unit: Num
    rerun_casts: Num
    after_plain: Num
    after_casts: Num
    kept_weight_share: Num
    group_none: Num
    group_casts: Num
    rerun_transient: Num


@lru_cache(maxsize=4096)
def policy_kind_counts(key: ModelKey, pp: int, virtual_stages: int, zbv: bool, pp_rank: int, recompute: int,
                       k: int) -> tuple[int, int, int, int, int]:
    """Alt-kind blocks (parts.alt_layers) among: the rank's plain blocks, the first re-run span, the plain blocks after
    it, and uniform's full group before it; and 1 if the span's last block is of the alt kind."""
    alt = set(alt_layers(key))
    split = layer_split(key.n_layers, pp * virtual_stages)
    stages = stages_of_rank(pp_rank, pp, virtual_stages, "zbv" if zbv else "1f1b")
    name = RECOMPUTE_NAMES[recompute]

    def alts(layers: list[int], span: range) -> int:
        return sum(layers[j] in alt for j in span)

    plain_alt = 0
    for stage in stages:
        layers = list(split[stage])
        plain_alt += sum(alts(layers, span) for span, checkpointed in groups(len(layers), name, k) if not checkpointed)
    last = list(split[max(stages)])
    spans = groups(len(last), name, k)
    ckpts = [i for i, (_, checkpointed) in enumerate(spans) if checkpointed]
    if not ckpts:
        return plain_alt, 0, alts(last, range(len(last))), 0, 0
    i = ckpts[-1]
    after = sum(alts(last, span) for span, _ in spans[i + 1:])
    group = alts(last, spans[i - 1][0]) if name == "uniform" and i > 0 else 0
    span = spans[i][0]
    return plain_alt, alts(last, span), after, group, int(last[span[-1]] in alt)


def kind_bytes(terms: tuple[Num, ...], casts: tuple[Num, Num], rerun_transient: Num = 0.0) -> KindBytes:
    """KindBytes from rank_activation_terms' first three terms, a block's (weight, bias) casts and its re-run
    transient."""
    return KindBytes(terms[0], terms[1], terms[2], *casts, rerun_transient)


def policy_blocks(model: ModelSpec, layout: Layout, pp_rank: Num, parts: RankParts, ck: Checkpointing,
                  kinds: tuple[KindBytes, KindBytes]) -> PolicyBlocks:
    """PolicyBlocks of one rank (layout fields and pp_rank broadcast together); kinds: block 0's kind's bytes and the
    other kind's (read only in a mixed stack)."""
    base, alt = kinds
    r, k, n = ck.rerun_blocks, maximum(layout.recompute_layers, 1), parts.stages.n_blocks
    one = base.weight_casts + base.bias_casts
    if not is_mixed(model):
        return PolicyBlocks(blocks=ck.units * base.unit + ck.plain * base.plain, rerun_none=r * base.none,
                            rerun_unit=base.unit, rerun_casts=r * one, after_plain=ck.after * base.plain,
                            after_casts=ck.after * one, kept_weight_share=ck.plain / maximum(n, 1),
                            group_none=k * base.none, group_casts=k * one, rerun_transient=base.rerun_transient)
    key = model_key(model)
    counts = per_distinct(lambda *row: policy_kind_counts(key, *row), layout.pp, layout.virtual_stages, layout.zbv,
                          pp_rank, layout.recompute, layout.recompute_layers)
    plain_alt, rerun_alt, after_alt, group_alt, last_alt = counts if isinstance(counts, tuple) else \
        (counts[..., i] for i in range(5))
    n_alt = parts.stages.n_alt

    def mix(count: Num, of_alt: Num, field: str) -> Num:
        return (count - of_alt) * getattr(base, field) + of_alt * getattr(alt, field)

    def casts(count: Num, of_alt: Num) -> Num:
        return mix(count, of_alt, "weight_casts") + mix(count, of_alt, "bias_casts")

    # a uniform group's checkpoint keeps its input only, the same bytes for either kind
    blocks = mix(ck.units, maximum(0, n_alt - plain_alt), "unit") + mix(ck.plain, plain_alt, "plain")
    weights = mix(n, n_alt, "weight_casts")
    return PolicyBlocks(blocks=blocks, rerun_none=mix(r, rerun_alt, "none"),
                        rerun_unit=where(rerun_alt >= r, alt.unit, base.unit), rerun_casts=casts(r, rerun_alt),
                        after_plain=mix(ck.after, after_alt, "plain"), after_casts=casts(ck.after, after_alt),
                        kept_weight_share=where(weights > 0, mix(ck.plain, plain_alt, "weight_casts")
                                                / maximum(weights, 1), 0),
                        group_none=mix(k, group_alt, "none"), group_casts=casts(k, group_alt),
                        rerun_transient=where(last_alt > 0, alt.rerun_transient, base.rerun_transient))
