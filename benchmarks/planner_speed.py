"""Planner speed: layouts searched per second for a 70B model on 1,024 GPUs (issue 13 target: >= 1e5/s).

  .venv/bin/python benchmarks/planner_speed.py

Prints, side by side: the vectorised screen (enumerate + numpy memory/time of every layout), the exact
worst-rank memory path (planner.memory) and the full estimator (estimate.estimate) per layout, and the
end-to-end `plan` (screen + confirmation of the fastest candidates). CPU time is reported next to wall time
because this machine is shared.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.analytic.estimate import estimate  # noqa: E402
from backend.analytic.steptime.hardware import get_hardware  # noqa: E402
from backend.planner.memory import light_spec, worst_rank_bytes  # noqa: E402
from backend.planner.screen import screen  # noqa: E402
from backend.planner.search import plan  # noqa: E402
from backend.planner.space import enumerate_layouts, layout_spec_dict  # noqa: E402
from backend.spec import ExperimentSpec, ModelSpec  # noqa: E402

LLAMA70B = ModelSpec(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672, seq_len=4096)
GPUS, NODE, BATCH = 1024, 8, 1024


def timed(fn, repeats: int = 5):
    best_wall = best_cpu = float("inf")
    out = None
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        best_wall, best_cpu = min(best_wall, time.perf_counter() - w), min(best_cpu, time.process_time() - c)
    return out, best_wall, best_cpu


def main() -> None:
    hw = get_hardware("h100-sxm")

    def screen_all():
        L = enumerate_layouts(LLAMA70B, gpus=GPUS, gpus_per_node=NODE, global_batch=BATCH)
        screen(LLAMA70B, L, hw=hw, global_batch=BATCH, gpus_per_node=NODE)
        return L

    L, wall, cpu = timed(screen_all)
    n = len(L)
    print(f"70B (LLaMA-70B shape) on {GPUS} GPUs, batch {BATCH}: {n} layouts")
    print(f"  screen (enumerate + vectorised memory/time): {wall:.3f} s wall, {cpu:.3f} s CPU -> {n / wall:,.0f} layouts/s wall, "
          f"{n / cpu:,.0f} layouts/s CPU (target 1e5)")
    sample = [layout_spec_dict(LLAMA70B, L[i], global_batch=BATCH) for i in range(0, n, max(1, n // 20))][:20]
    _, w2, c2 = timed(lambda: [worst_rank_bytes(light_spec(d)) for d in sample], repeats=1)
    print(f"  exact worst-rank memory (planner.memory): {len(sample) / w2:,.1f} layouts/s wall ({len(sample) / c2:,.1f} CPU)")
    _, w3, c3 = timed(lambda: [estimate(ExperimentSpec.for_prediction(d)) for d in sample[:5]], repeats=1)
    print(f"  full estimator (estimate.estimate, every rank): {5 / w3:,.2f} layouts/s wall ({5 / c3:,.2f} CPU)")
    w, c = time.perf_counter(), time.process_time()
    res = plan(LLAMA70B, gpus=GPUS, gpus_per_node=NODE, hw=hw, global_batch=BATCH, top=5)
    print(f"  end-to-end plan: {time.perf_counter() - w:.1f} s wall, {time.process_time() - c:.1f} s CPU; "
          f"{res.searched} searched, {res.confirmed} confirmed exactly, {res.feasible} fit")
    best = res.configs[0]
    print(f"  best: {best['spec']['name']}, b={best['spec']['train']['micro_batch']}, {best['spec']['train']['recompute']}, "
          f"{best['step_time']['step_s']:.2f} s/step, MFU {best['step_time']['mfu']:.1%}, {best['mem_bytes_max'] / 1e9:.1f} GB")


if __name__ == "__main__":
    main()
