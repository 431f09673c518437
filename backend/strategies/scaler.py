"""Loss scaling for fp16-mixed: without it small fp16 gradients underflow to zero.

One `LossScaling` per rank, built once after the optimizer (strategies/parallelize.py; the single-process
reference builds its own, engine/reference.py) and owned by the one optimizer tail (strategies/step.py
`OptimizerTail`). It wraps torch's `ShardedGradScaler` (a `torch.amp.GradScaler` whose inf/NaN flag is
all-reduced over a process group), in the variant `torch_compat.LocalShardGradScaler` that checks and unscales
each gradient's local tensor (a DTensor grad by its shard: torch's own check rejects a list mixing DTensor and
plain grads). Its found-inf flag is reduced over the WORLD for every strategy, so when any rank's gradients
overflowed every rank skips the same step (FSDP2 shards, TP shards, pipeline stages and experts hold different
gradients; DDP ranks hold equal ones and lose nothing by the reduction). bf16 and fp32 need no scaling: the
scaler is then disabled and every call is a pass-through.

The call pattern (one microbatch loop for every strategy):
    scaling = LossScaling(spec, device)                 # once, after the optimizer exists
    loss = loss_fn(logits, y) / n_microbatches
    scaling.scale(loss).backward()                      # each microbatch (PP: inside the schedule's loss_fn)
    ... gradient reductions that happen outside backward (e.g. reduce_partial_grads, expert grads) ...
    scaling.step(optimizer)                             # instead of optimizer.step(); unscale, skip on inf, update
    optimizer.zero_grad(...)
Losses reported to the user are the unscaled ones (the loop reports the loss before scaling; the pipeline,
whose schedule keeps the scaled losses, divides by `scale_value()` taken before `step`). Skipped steps are
counted by step index (0 = the first step this object ran) in `report`, which the engine publishes as
`Prepared.extra["loss_scaling"]`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from backend.torch_compat import LocalShardGradScaler


class LossScaling:
    """Dynamic loss scaling for fp16-mixed (torch's defaults: init 2**16, x0.5 on overflow, x2 every 2000 steps)."""

    def __init__(self, spec: Any, device: torch.device, group: Any = None, *, distributed: bool | None = None) -> None:
        """distributed: agree on skipping over `group` (default WORLD); default: whenever a process group exists.
        The reference passes False: it runs in a process forked from rank 0, where the group still looks initialized."""
        self.enabled = str(spec.train.precision) == "fp16-mixed"
        self.steps = 0
        self.skipped_steps: list[int] = []
        self.report: dict[str, Any] = {}
        kind = torch.device(device).type
        if distributed is None:
            distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            self._scaler = LocalShardGradScaler(device=kind, enabled=self.enabled,
                                                process_group=group or dist.group.WORLD)
        else:  # one process (the single-process reference): nothing to agree on
            self._scaler = torch.amp.GradScaler(kind, enabled=self.enabled)
        if self.enabled:  # creates the scale now: a pipeline stage without the loss never calls scale() itself
            self._scaler.scale(torch.zeros((), device=device))

    @property
    def steps_skipped(self) -> int:
        return len(self.skipped_steps)

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
        after = self._scaler.get_scale()
        stepped = not after < before  # update() backs the scale off only after a skipped step
        if not stepped:
            self.skipped_steps.append(self.steps)
        self.steps += 1
        self.report.update(skipped_steps=list(self.skipped_steps), steps=self.steps, scale=float(after))
        return stepped
