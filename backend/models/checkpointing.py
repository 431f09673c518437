"""The recompute policies of backend/recompute_policy.py run through torch's checkpoint API: which blocks of a
stage module go into which non-reentrant `torch.utils.checkpoint` call, and the op-level policy
(`create_selective_checkpoint_contexts`) that saves the outputs of the listed ops except every second aten.mm, as
torchtitan's `_apply_op_sac` (torchtitan/distributed/activation_checkpoint.py) does."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from backend.recompute_policy import groups

BLOCK_LEVEL = ("full", "op", "layers", "block", "uniform")


def resolve_ops(names: tuple[str, ...]) -> set[Any]:
    """'aten.mm.default' -> torch.ops.aten.mm.default; a name this torch lacks is skipped (the CPU or CUDA-only
    kernels of the default list)."""
    out = set()
    for name in names:
        namespace, op, overload = name.split(".")
        try:
            out.add(getattr(getattr(getattr(torch.ops, namespace), op), overload))
        except (AttributeError, RuntimeError):
            continue
    return out


def op_policy(save: set[Any]) -> Callable[[], Any]:
    """The context_fn of one checkpointed block: a fresh mm counter per forward and per recompute."""

    def context_fn() -> Any:
        counts: dict[str, int] = defaultdict(int)

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            key = "recompute" if ctx.is_recompute else "forward"
            if func == torch.ops.aten.mm.default:
                counts[key] += 1
            keep = func in save and not (func == torch.ops.aten.mm.default and counts[key] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def run_blocks(blocks: list[torch.nn.Module], h: torch.Tensor, kind: str, layers: int,
               context_fn: Callable[[], Any] | None) -> torch.Tensor:
    """The blocks of one stage module under the policy (no checkpoint outside autograd: eval, the trace's
    metadata passes)."""
    if kind not in BLOCK_LEVEL or not torch.is_grad_enabled():
        for block in blocks:
            h = block(h)
        return h
    kw = {"context_fn": context_fn} if kind == "op" else {}
    for span, checkpointed in groups(len(blocks), kind, layers):
        run = partial(_run, [blocks[j] for j in span])
        h = checkpoint(run, h, use_reentrant=False, **kw) if checkpointed else run(h)
    return h


def _run(blocks: list[torch.nn.Module], h: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        h = block(h)
    return h
