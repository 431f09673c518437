"""The allocator phase's child (backend/gpucheck/allocator.py): how much of the caching allocator's slack a training
step needs, under the PYTORCH_CUDA_ALLOC_CONF the parent set before this process imported torch.

One GPU-check model (the zero3 run's 1B Llama shape, the model, autocast bf16, AdamW: the ddp run's step at world
1, without a process group) trains one step unconstrained after a warm-up step: its peak allocated and peak reserved
bytes (the reserve, the slack analytic/device.RuntimeOverhead.fragmentation_frac prices). Then the per-process cap
(torch.cuda.set_per_process_memory_fraction, which bounds what the allocator may reserve; past it, the allocator frees
its unsplit cached blocks and retries before raising OutOfMemoryError) is bisected between the two for the smallest
cap at which the step still runs: the slack a step needs under memory pressure. Prints one JSON object.

    python -m backend.gpucheck.allocator_probe --device cuda [--run zero3] [--tries 6]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any


def smallest_cap(fits: Callable[[float], bool], low: float, high: float, tries: int) -> tuple[float, list[dict]]:
    """Bisect (low, high] for the smallest cap at which `fits(cap)` holds, `high` known to fit; returns it and each
    try (cap, fits). `low` is where it cannot fit (the peak allocated: every byte of it is live at once)."""
    log: list[dict[str, Any]] = []
    for _ in range(tries):
        mid = (low + high) / 2
        ok = fits(mid)
        log.append({"cap_bytes": mid, "fits": ok})
        low, high = (low, mid) if ok else (mid, high)
    return high, log


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--run", default="zero3")
    ap.add_argument("--tries", type=int, default=6)
    args = ap.parse_args(argv)
    if args.device != "cuda":
        print(json.dumps({"status": "skipped", "reason": "the caching allocator is CUDA's: nothing to measure on "
                                                         f"device {args.device}"}))
        return 0
    print(json.dumps(measure(args.run, args.tries)))
    return 0


def measure(run_name: str, tries: int) -> dict[str, Any]:
    import torch

    from backend.gpucheck.specs import runs_for, spec_for
    from backend.models.gpt import build_model, loss_fn

    spec = spec_for(runs_for(1, [run_name])[0], device="cuda", nproc=1, timeout_s=60.0)
    m = spec.model
    model = build_model(m, seed=0, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, m.vocab_size, (spec.train.micro_batch, m.seq_len), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    total = torch.cuda.get_device_properties(0).total_memory
    step()  # the optimizer's state
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.monotonic()
    step()
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()

    def fits(cap: float) -> bool:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
        try:
            step()
            torch.cuda.synchronize()
            return True
        except torch.cuda.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            return False

    cap, log = smallest_cap(fits, allocated, reserved, tries)
    torch.cuda.set_per_process_memory_fraction(1.0)
    return {"status": "ok", "run": run_name, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "torch": torch.__version__, "device_name": torch.cuda.get_device_name(0), "total_bytes": total,
            "step_s": time.monotonic() - t0, "peak_allocated_bytes": allocated, "peak_reserved_bytes": reserved,
            "reserve_slack": reserved / allocated - 1.0, "smallest_cap_bytes": cap,
            "needed_slack": cap / allocated - 1.0, "resolution_bytes": (reserved - allocated) / 2 ** tries,
            "tries": log}


if __name__ == "__main__":
    sys.exit(main())
