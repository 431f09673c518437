"""Loss scaling for fp16-mixed: without it small fp16 gradients underflow to zero.

One `LossScaling` per rank, built once after the optimizer. It wraps torch's own
`torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler` (a `torch.amp.GradScaler` whose inf/NaN check is all-reduced
over a process group) for every strategy: its found-inf flag is reduced over the WORLD, so when any rank's
gradients overflowed every rank skips the same step (FSDP2 shards, TP shards and pipeline stages hold
different gradients; DDP ranks hold equal ones and lose nothing by the reduction). DTensor gradients also
reduce the flag over their own mesh (DTensor's `found_inf_reduce_handler`). bf16 and fp32 need no scaling:
the scaler is then disabled and every call is a pass-through.

Where the step loop calls it (one microbatch loop for every strategy):
    scaling = LossScaling(spec, device)                 # once, after the optimizer exists
    loss = loss_fn(logits, y) / n_microbatches
    scaling.scale(loss).backward()                      # each microbatch (PP: inside the schedule's loss_fn)
    ... gradient reductions that happen outside backward (e.g. reduce_partial_grads) ...
    scaling.step(optimizer)                             # instead of optimizer.step(); unscale, skip on inf, update
    optimizer.zero_grad(...)
Losses reported to the user are the unscaled ones (divide a scaled loss by `scaling.scale_value()`).
"""

from __future__ import annotations

from typing import Any

import torch


class LossScaling:
    """Dynamic loss scaling for fp16-mixed (torch's defaults: init 2**16, x0.5 on overflow, x2 every 2000 steps)."""

    def __init__(self, spec: Any, device: torch.device, group: Any = None) -> None:
        import torch.distributed as dist

        self.enabled = str(spec.train.precision) == "fp16-mixed"
        self.steps_skipped = 0
        kind = torch.device(device).type
        if dist.is_available() and dist.is_initialized():
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self._scaler = ShardedGradScaler(device=kind, enabled=self.enabled, process_group=group or dist.group.WORLD)
        else:  # one process (the single-process reference): nothing to agree on
            self._scaler = torch.amp.GradScaler(kind, enabled=self.enabled)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on (scaled for fp16-mixed, else unchanged)."""
        return self._scaler.scale(loss) if self.enabled else loss

    def scale_value(self) -> float:
        return float(self._scaler.get_scale()) if self.enabled else 1.0

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale the gradients, run optimizer.step() unless some rank's gradients hold inf/NaN, update the
        scale. Returns whether the optimizer stepped (the same on every rank)."""
        if not self.enabled:
            optimizer.step()
            return True
        before = self._scaler.get_scale()
        self._scaler.step(optimizer)
        self._scaler.update()
        stepped = not self._scaler.get_scale() < before  # update() backs the scale off only after a skipped step
        self.steps_skipped += 0 if stepped else 1
        return stepped
