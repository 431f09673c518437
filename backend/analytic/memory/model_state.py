"""Parameters, gradients and optimizer state of one rank at the activation peak (one layout or arrays of them).

- params: fp32 storage (torch keeps fp32 parameters under autocast and FSDP2's MixedPrecisionPolicy), FSDP2 incl.
  dim-0 padding, plus what is unsharded at the peak (fsdp_state.py) in the unsharded dtype. ddp on the dp
  dimension of a tp/pp mix is FSDP2 `replicate`: an unsharded copy of every parameter stays resident (2x).
- grads: resident from the previous step (zero_grad(set_to_none=False)), fp32: DDP / ZeRO-1 one copy per local
  parameter (classic DDP's `.grad` are views of its buckets: no per-tensor rounding); FSDP2 the padded sharded
  gradient (views of each unit's reduce-scatter output) plus the unsharded gradients accumulated before the
  peak; `replicate` without sync on earlier microbatches accumulates unsharded grads next to the reduced ones.
- optimizer: AdamW m and v (8 B per owned element) + a 0-dim fp32 `step` per tensor, SGD one momentum buffer;
  ZeRO-1 only this dp index's share (zero1_share.py), FSDP2 the unpadded local shard.
On CUDA every parameter / optimizer storage is rounded to 512 B (device.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from backend.analytic.device import CUDA
from backend.analytic.layout import Layout, RankPosition, ZeroStage
from backend.analytic.memory.fsdp_state import UnshardedAtPeak
from backend.analytic.memory.parts import RankParts, tied_copy
from backend.analytic.memory.zero1_share import Zero1Shares, zero1_share_args, zero1_shares
from backend.analytic.optimizer_state import state_bytes_from_sums
from backend.analytic.params import ModelKey, model_key
from backend.analytic.scalar_or_array import (
    any_true,
    logical_and,
    logical_not,
    logical_or,
    per_distinct,
    per_value,
    where,
)
from backend.analytic.traffic import MASTER_BYTES

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num
    from backend.spec import ModelSpec


@dataclass(frozen=True)
class ModelStateBytes:
    params_bytes: Num
    grads_bytes: Num
    optimizer_bytes: Num


def _optimizer_over(parts: RankParts, layout: Layout, *, owned: str, cuda: str) -> Num:
    return state_bytes_from_sums(elements=parts.total(owned), tensors=parts.total("tensors"),
                                 cuda_bytes=parts.total(cuda) if layout.device == CUDA else 0,
                                 optimizer=layout.optimizer, device=layout.device)


def sharded_state(layout: Layout, parts: RankParts, unsharded: UnshardedAtPeak) -> ModelStateBytes:
    """FSDP2 (zero2 / zero3)."""
    shards = MASTER_BYTES * parts.total("storage_numel")
    storage = parts.total("cuda_storage_bytes") if layout.device == CUDA else shards  # one storage per parameter
    return ModelStateBytes(params_bytes=storage + layout.fsdp_param_bytes * unsharded.params_numel,
                           grads_bytes=shards + MASTER_BYTES * unsharded.grads_numel,  # reduce_dtype fp32
                           optimizer_bytes=_optimizer_over(parts, layout, owned="real_numel", cuda="cuda_real_bytes"))


def replicated_state(model: ModelSpec, layout: Layout, position: RankPosition, parts: RankParts) -> ModelStateBytes:
    """DDP, ZeRO-1 and FSDP2 `replicate`."""
    cuda = layout.device == CUDA
    per_param = MASTER_BYTES * parts.total("local_numel")
    params = parts.total("cuda_local_bytes") if cuda else per_param
    in_buckets = logical_and(layout.dp_cp > 1, logical_not(layout.uses_replicate))  # zero < 2 here
    grads = where(logical_or(in_buckets, not cuda), per_param, params)
    replicate = layout.uses_replicate
    if any_true(replicate):
        # replicate's unsharded copy and accumulated grads cover what it manages: not ep's experts (ignored_params)
        experts = parts.total("ep_expert_numel")
        expert_bytes = parts.total("cuda_ep_expert_bytes") if cuda else MASTER_BYTES * experts
        params = where(replicate, 2 * params - expert_bytes, params)
        grads = where(logical_and(replicate, layout.microbatches > 1),
                      grads + MASTER_BYTES * (parts.total("unsharded_grad_numel") - experts), grads)
    def optimizer(lay: Layout, pos: RankPosition, prt: RankParts, zero1: bool) -> Num:
        if zero1:
            return zero1_optimizer_bytes(model, lay, pos, prt)
        return _optimizer_over(prt, lay, owned="local_numel", cuda="cuda_local_bytes")

    optimizer = per_value(logical_and(layout.zero_stage == ZeroStage.ZERO1, layout.dp_cp > 1), optimizer, layout,
                          position, parts)
    return ModelStateBytes(params, grads, optimizer)


def zero1_optimizer_bytes(model: ModelSpec, layout: Layout, position: RankPosition, parts: RankParts) -> Num:
    """ZeRO-1: the optimizer state of the rank's share (or the largest share: position.largest_zero1_share)."""
    key, s = model_key(model), parts.stages
    fixed = (key, layout.optimizer, layout.device, bool(position.largest_zero1_share))
    return per_distinct(lambda *row: _zero1_state_bytes(*fixed, *row), layout.tp, layout.dp_cp, layout.ep,
                        position.tp_index, position.ep_index, position.dp_index, s.n_blocks, s.first, s.last,
                        tied_copy(model, layout), s.n_alt, layout.etp)


@lru_cache(maxsize=65536)
def _zero1_state_bytes(key: ModelKey, optimizer: str, device: str, largest: bool, tp: int, dp: int, ep: int,
                       tp_index: int, ep_index: int, dp_index: int, n_blocks: int, first: int, last: int, tied: int,
                       n_alt: int = 0, etp: int = 1) -> int:
    shares = zero1_shares(key, (tp, dp, ep, 0, tp_index, 0, ep_index, etp), n_blocks, bool(first), bool(last),
                          bool(tied), dp, n_alt)
    return shares.largest(optimizer, device) if largest else shares.bytes(dp_index, optimizer, device)[0]


def zero1_optimizer_step(model: ModelSpec, layout: Layout, position: RankPosition, parts: RankParts) -> Num:
    """ZeRO-1: optimizer.step's temporaries of the rank's share; with position.largest_zero1_share the largest state +
    temporaries of any share minus the largest state (zero1_share.Zero1Shares.step_over_largest)."""
    key, s = model_key(model), parts.stages
    fixed = (key, layout.optimizer, layout.device, bool(position.largest_zero1_share))
    return per_distinct(lambda *row: _zero1_step_bytes(*fixed, *row), layout.tp, layout.dp_cp, layout.ep,
                        position.tp_index, position.ep_index, position.dp_index, s.n_blocks, s.first, s.last,
                        tied_copy(model, layout), s.n_alt)


@lru_cache(maxsize=65536)
def _zero1_step_bytes(key: ModelKey, optimizer: str, device: str, largest: bool, tp: int, dp: int, ep: int,
                      tp_index: int, ep_index: int, dp_index: int, n_blocks: int, first: int, last: int, tied: int,
                      n_alt: int = 0) -> int:
    shares = zero1_shares(key, (tp, dp, ep, 0, tp_index, 0, ep_index), n_blocks, bool(first), bool(last), bool(tied),
                          dp, n_alt)
    return shares.step_over_largest(optimizer, device) if largest else shares.bytes(dp_index, optimizer, device)[1]


def zero1_shares_of(model: ModelSpec, layout: Layout, position: RankPosition, parts: RankParts) -> Zero1Shares:
    """The partition a scalar ZeRO-1 rank's dp group shares (rank classes answer per dp index from it)."""
    return zero1_shares(*zero1_share_args(model_key(model), layout, parts, position, tied_copy(model, layout)))
