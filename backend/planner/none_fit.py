"""When no searched layout fits (planner/search.py `plan`): the closest one, the layout with the smallest predicted
per-GPU memory, confirmed on that layout alone with the estimator's own core (estimate.worst_rank_bytes, the numbers
`estimate` gives for it: its fullest moment and need = fullest + the runtime allowance, analytic/device.need_bytes),
against the device; and, when that layout's model states (params + grads + optimizer) alone exceed the device, how many
GPUs of this kind they need at least. The CLI, `plan --json`'s "none_fit" and the Plan page show its "text"."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from backend.analytic.device import RuntimeOverhead, allowance_bytes
from backend.analytic.estimate import RankEstimate, worst_rank_bytes
from backend.analytic.layout import Layout
from backend.analytic.memory.rank_memory import worst_rank_memory
from backend.planner.held import HeldTraining
from backend.planner.retime import Screened, layout_label
from backend.planner.space import light_spec
from backend.spec import ModelSpec

CHUNK = 512
"""Layouts whose exact worst-rank memory is computed at once while looking for the smallest."""
GIB = 2**30
FULLY_SHARDED = 3
"""ZeRO stage 3 (zero3 / FSDP): params, grads and optimizer state all sharded over the data-parallel ranks."""


def smallest_layout(model: ModelSpec, layouts: Layout, bound: np.ndarray) -> tuple[int, float]:
    """(index, worst-rank bytes) of the layout with the smallest worst-rank memory. `bound`: search()'s bytes, exact
    or a lower bound of them (a pruned layout's); the exact bytes are computed smallest bound first, until the next
    bound is no smaller than the best found (no later layout can be smaller)."""
    order = np.argsort(bound, kind="stable")
    best_i, best = -1, math.inf
    for start in range(0, len(order), CHUNK):
        chunk = order[start:start + CHUNK]
        if bound[chunk[0]] >= best:
            break
        exact = np.broadcast_to(worst_rank_memory(model, layouts.take(chunk, with_memo=True))[0], chunk.shape)
        j = int(np.argmin(exact))
        if exact[j] < best:
            best_i, best = int(chunk[j]), float(exact[j])
    return best_i, best


def closest_layout(screens: list[Screened], held: HeldTraining, device_bytes: float,
                   overhead: RuntimeOverhead) -> dict[str, Any] | None:
    """{"layout", "spec", "mem_bytes_max", "fullest_moment", "need_bytes", "allowance_bytes", "device_bytes",
    "over_bytes", "states", "text"} of the layout with the smallest worst-rank memory over every screen (None when
    nothing was searched)."""
    found = [(b, s, i) for s in screens if len(s.layouts) for i, b in [smallest_layout(s.model, s.layouts, s.memory)]]
    if not found:
        return None
    _, screen, i = min(found, key=lambda f: f[0])
    data = screen.layouts.take(i).spec_dict(screen.model)
    data["train"].update(held.spec_train(data["train"]["recompute"]))
    spec = light_spec(data)
    worst, rank = worst_rank_bytes(spec)  # estimate's number for this layout alone
    allowance = allowance_bytes(worst, spec.parallel, str(spec.runtime.device), overhead)
    need = worst + float(allowance["total"])
    out = {"layout": layout_label(data), "spec": data, "mem_bytes_max": int(worst),
           "fullest_moment": rank.fullest_moment(), "need_bytes": need,
           "allowance_bytes": {k: float(v) for k, v in allowance.items()}, "device_bytes": device_bytes,
           "over_bytes": need - device_bytes,
           "states": _states(rank, spec.parallel.world_size, device_bytes - float(allowance["cuda_context"]),
                             sharded=spec.parallel.zero_stage >= FULLY_SHARDED)}
    out["text"] = none_fit_text(out, sum(len(s.layouts) for s in screens))
    return out


def _states(rank: RankEstimate, world: int, room: float, *, sharded: bool) -> dict[str, Any]:
    """The layout's model states per GPU and in all (per GPU x its GPUs), the room a GPU leaves them (the device less
    the CUDA context), and the GPUs they need at least: ceil(total / room); None where the states fit on these GPUs,
    or where the layout does not shard every state over its GPUs (then per GPU x GPUs is not their total)."""
    per_gpu = float(rank.params_bytes + rank.grads_bytes + rank.optimizer_bytes)
    total = per_gpu * world
    return {"per_gpu_bytes": per_gpu, "gpus": world, "total_bytes": total, "room_bytes": room,
            "gpus_needed": math.ceil(total / room) if sharded and per_gpu > room else None}


def none_fit_text(nf: dict[str, Any], searched: int) -> str:
    """The explanation in words, with the arithmetic."""
    a, s = nf["allowance_bytes"], nf["states"]
    text = (f"No layout fits: none of the {searched:,} layouts searched fits the {nf['device_bytes'] / GIB:.1f} GiB "
            f"of a GPU. The closest (smallest predicted memory per GPU) is {nf['layout']}: it needs "
            f"{nf['need_bytes'] / GIB:.1f} GiB per GPU ({nf['mem_bytes_max'] / GIB:.1f} GiB at its fullest moment, "
            f"{nf['fullest_moment']}, + {a['total'] / GIB:.1f} GiB CUDA context, NCCL buffers and allocator slack), "
            f"{nf['over_bytes'] / GIB:.1f} GiB over the device.")
    if s["gpus_needed"] is not None:
        text += (f" Its model states alone (params + grads + optimizer) are {s['per_gpu_bytes'] / GIB:.1f} GiB per "
                 f"GPU x {s['gpus']} GPUs = {s['total_bytes'] / GIB:.1f} GiB; each GPU has "
                 f"{s['room_bytes'] / GIB:.1f} GiB for them (the device less the CUDA context): "
                 f"{s['total_bytes'] / GIB:.1f} / {s['room_bytes'] / GIB:.1f} = "
                 f"{s['total_bytes'] / s['room_bytes']:.2f}, so at least {s['gpus_needed']} GPUs of this kind, "
                 "activations and buffers on top.")
    return text + " More GPUs, a smaller batch per GPU, or more memory."
