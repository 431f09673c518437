"""Per-step MoE bookkeeping every layout shares: the load-balancing loss's backward scale and the tokens the
capacity limit dropped (models/moe_capacity.py), published in `Prepared.extra["moe_capacity"]`.

The record (JSON, replaced every step; engine/loop.py keeps the memory-tracked step's):
  {"routed": slots routed on this rank (every MoE layer and microbatch of the step, before the limit),
   "dropped": slots the limit dropped, "tokens": tokens per MoE call on this rank, "capacity_factor", "pad"}
Activation checkpointing's re-runs are not counted. tp ranks route the same tokens (the MoE input is the full
microbatch on each), so the assembled result counts one tp rank of each column (engine/assemble.py).
"""

from __future__ import annotations

from torch import nn

from backend.models.gpt import MoE
from backend.spec import ExperimentSpec


def moes(modules: list[nn.Module]) -> list[MoE]:
    return [sub for m in modules for sub in m.modules() if isinstance(sub, MoE)]


def set_aux_loss_scale(modules: list[nn.Module], scale: float) -> None:
    """The main loss's backward scale per microbatch, for every MoE's load-balancing loss (AuxLossScaler)."""
    for moe in moes(modules):
        moe.aux_loss_scale = scale


class CapacityStats:
    """Collects the MoE layers' dropped slots after each step's last backward (OptimizerTail's `after_backward`)."""

    def __init__(self, spec: ExperimentSpec, modules: list[nn.Module], extra: dict, tokens: int):
        self.spec, self.layers, self.extra, self.tokens = spec, moes(modules), extra, tokens

    def __call__(self) -> None:
        routed = dropped = 0
        for moe in self.layers:
            for n, d in moe.capacity_log:
                routed += n
                dropped += int(d)
            moe.capacity_log.clear()
        m = self.spec.model
        self.extra["moe_capacity"] = {"routed": routed, "dropped": dropped, "tokens": self.tokens,
                                      "capacity_factor": m.capacity_factor, "pad": bool(m.moe_pad_to_capacity)}
