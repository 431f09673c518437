"""Planner speed: layouts searched per second for a 70B model on 1,024 GPUs (issue 13 target: >= 1e5/s).

  .venv/bin/python benchmarks/planner_speed.py                     # Llama-2-70B as published (math attention)
  .venv/bin/python benchmarks/planner_speed.py --attention flash   # the same with flash: cp is searched too
  .venv/bin/python benchmarks/planner_speed.py --moe               # only the MoE plans (issue 30: under 3 s cold)

Prints, side by side: the search (enumerate + the prediction core's worst-rank memory of every layout on arrays +
the step-time screen + feasibility + ranking), the array memory alone, the same core on one layout at a time
(estimate.worst_rank_bytes, and the full estimate.estimate), the end-to-end `plan` (search + re-timing the pool with
steptime.model + confirming the reported memory), and an agreement check of the array path against
estimate.estimate on a random sample. Wall and CPU time: this machine is shared, CPU time is the steadier one.
Cold = first call in the process (python-side caches empty: ZeRO-1 partitions, interleaved FSDP states, local
parameters per rank, pipeline action orders); the end-to-end plan is also timed cold in a fresh subprocess.
Warm = best of 5 (plan: best of 3, the same plan again, so every cache already holds its layouts).

The issue's target (>= 1e5 layouts/s searched) is the search's rate, cold and warm: that is the work done per
layout. `plan` adds a fixed cost per call that does not grow with the layouts searched: re-timing a pool of
3 x top layouts with steptime.model and confirming the top's memory with the exact estimator. The last line says
whether the target is met; the end-to-end rates are printed beside it, not hidden.

MoE plans (issue 30 item 5): DeepSeek-V3 (tests/fixtures/hf/deepseek-v3.json, 61 layers, 256 routed experts) on 256
H100 at global batch 1,024 and sequence 4,096, `plan` end to end cold in a fresh process each (as the CLI runs it,
imports not counted), with flash attention (the GPU default: cp searched) and math, ranking only runnable layouts
and with --include-predicted; Mixtral-8x7B on 64 H100 beside them. Each case runs twice, side by side: without the
planner's pruning (--no-prune: the full memory model on every layout, the path before issue 30 item 5) and with it.
Target: each under 3 s cold (wall; CPU printed beside it, the steadier number on this shared machine). Written to
benchmarks/results/planner_moe.json.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from backend.analytic.estimate import estimate, worst_rank_bytes  # noqa: E402
from backend.analytic.memory.rank_memory import worst_rank_memory  # noqa: E402
from backend.analytic.steptime.hardware import get_hardware  # noqa: E402
from backend.planner.search import plan, search  # noqa: E402
from backend.planner.space import light_spec  # noqa: E402
from backend.spec import ExperimentSpec, ModelSpec  # noqa: E402

LLAMA70B = ModelSpec(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden=28672,
                     seq_len=4096,
                     norm="rmsnorm", mlp="swiglu", positions="rope", bias="none")  # Touvron 2023 (Llama 2) Table 1
GPUS, NODE, BATCH = 1024, 8, 1024
if "--attention" in sys.argv:  # flash attention admits context parallelism: the planner searches cp as well
    LLAMA70B = LLAMA70B.model_copy(update={"attention": sys.argv[sys.argv.index("--attention") + 1]})


def timed(fn, repeats: int = 5):
    best_wall = best_cpu = float("inf")
    out = None
    for _ in range(repeats):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        best_wall, best_cpu = min(best_wall, time.perf_counter() - w), min(best_cpu, time.process_time() - c)
    return out, best_wall, best_cpu


def main() -> None:
    import random

    hw = get_hardware("h100-sxm")
    def searched():  # plan()'s per-layout work, before it re-times its pool
        return search(LLAMA70B, gpus=GPUS, gpus_per_node=NODE, hw=hw, global_batch=BATCH, memory_bytes=hw.memory_bytes)

    (layouts, _, order), cold_w, cold_c = timed(searched, repeats=1)
    _, wall, cpu = timed(searched)
    n = len(layouts)
    cps = sorted(set(layouts.cp.tolist())) if hasattr(layouts, "cp") else [1]
    print(f"70B (Llama-2-70B shape, {LLAMA70B.attention} attention) on {GPUS} GPUs, batch {BATCH}: {n} layouts "
          f"(cp {cps}), {len(order)} fit {hw.memory_bytes / 1e9:.1f} GB with their allowance")
    print(f"  search (enumerate + core memory on arrays + step-time screen + rank), warm: {wall:.3f} s wall, "
          f"{cpu:.3f} s CPU -> {n / wall:,.0f} layouts/s wall, {n / cpu:,.0f} layouts/s CPU (target 1e5)")
    print(f"  search, cold (first call): {cold_w:.3f} s wall, {cold_c:.3f} s CPU -> {n / cold_w:,.0f} /s wall, "
          f"{n / cold_c:,.0f} /s CPU")
    # a fresh copy each time: the layouts' memoised per-layout terms would make repeats cheaper than a search's call
    (mem, _), w1, c1 = timed(lambda: worst_rank_memory(LLAMA70B, dataclasses.replace(layouts)))
    print(f"  worst-rank memory on arrays alone: {n / w1:,.0f} layouts/s wall, {n / c1:,.0f} CPU")
    sample = [layouts.take(i).spec_dict(LLAMA70B) for i in range(0, n, max(1, n // 20))][:20]
    _, w2, c2 = timed(lambda: [worst_rank_bytes(light_spec(d)) for d in sample], repeats=1)
    print(f"  worst-rank memory one layout at a time (estimate.worst_rank_bytes): {len(sample) / w2:,.1f} layouts/s "
          f"wall ({len(sample) / c2:,.1f} CPU)")
    idx = random.Random(0).sample(range(n), 25)
    exact, w3, c3 = timed(lambda: [max(r.fullest_bytes() for r in estimate(ExperimentSpec.for_prediction(
        layouts.take(i).spec_dict(LLAMA70B))).per_rank) for i in idx], repeats=1)
    print(f"  full estimator (estimate.estimate, every rank): {len(idx) / w3:,.2f} layouts/s wall "
          f"({len(idx) / c3:,.2f} CPU)")
    rel = [abs(mem[i] - e) / e for i, e in zip(idx, exact, strict=False)]
    print(f"  agreement on {len(idx)} random layouts: array path vs estimate.estimate worst rank, max |rel err| "
          f"{max(rel):.2e} (tests/unit/test_planner_core.py checks 1,000 byte for byte)")
    cold = subprocess.run([sys.executable, __file__, "--cold-plan", "--attention", str(LLAMA70B.attention)],
                          capture_output=True, text=True, check=True)
    print("  " + cold.stdout.strip())
    for top in (5, 10):
        for label in ("first call here (search caches warm, new pool)", "warm (same plan again: every cache filled)"):
            # timed calls the lambda before the loop moves on, so it sees this iteration's top
            res, w, c = timed(lambda: plan(LLAMA70B, gpus=GPUS, gpus_per_node=NODE, hw=hw, global_batch=BATCH,
                                           top=top),  # noqa: B023
                              repeats=1 if label.startswith("first") else 3)
            print(f"  end-to-end plan --top {top}, {label}: {w:.3f} s wall, {c:.3f} s CPU -> {res.searched / w:,.0f} "
                  f"layouts/s wall, {res.searched / c:,.0f} CPU; search {res.search_seconds:.3f} s + "
                  f"re-timing {res.confirmed} and confirming {len(res.configs)} exactly {res.confirm_seconds:.3f} s "
                  f"(wall); {res.feasible} fit")
    met = min(n / wall, n / cold_w) >= 1e5
    print(f"  TARGET >= 1e5 layouts/s searched (search, cold and warm): {'met' if met else 'MISSED'} "
          f"(cold {n / cold_w:,.0f}/s, warm {n / wall:,.0f}/s)")
    best = res.configs[0]
    print(f"  best: {best['spec']['name']}, b={best['spec']['train']['micro_batch']}, "
          f"{best['spec']['train']['recompute']}, {best['step_time']['step_s']:.2f} s/step, MFU "
          f"{best['step_time']['mfu']:.1%}, {best['mem_bytes_max'] / 1e9:.1f} GB")


MOE_CASES = (("deepseek-v3", 256, 1024), ("mixtral-8x7b", 64, 512))
MOE_TARGET_S = 3.0
MOE_RESULTS = Path(__file__).resolve().parent / "results" / "planner_moe.json"


def moe_plans() -> None:
    """Each MoE case cold in a fresh process (flash and math; runnable only and --include-predicted), side by side
    without pruning (search(prune=False): the full memory model on every layout, as before issue 30 item 5) and with
    it (the default); the same best layout either way. Writes MOE_RESULTS."""
    import json
    import os

    print("MoE plans, end to end, COLD (a fresh process each; target < 3 s); unpruned | pruned:")
    worst, rows = 0.0, []
    for name, gpus, batch in MOE_CASES:
        for attention in ("flash", "math"):
            for predicted in (False, True):
                runs = {}
                for prune in (False, True):
                    args = [sys.executable, __file__, "--cold-moe", name, str(gpus), str(batch), attention] \
                        + (["--include-predicted"] if predicted else []) + ([] if prune else ["--no-prune"])
                    load = os.getloadavg()[0]
                    runs[prune] = {**json.loads(subprocess.run(args, capture_output=True, text=True,
                                                               check=True).stdout),
                                   "load_avg_1m_before": round(load, 2)}
                before, after = runs[False], runs[True]
                worst = max(worst, after["wall_s"])
                same = before["best"] == after["best"] and before["feasible"] == after["feasible"]
                print(f"  {after['case']}: unpruned {before['wall_s']:.2f} s wall / {before['cpu_s']:.2f} s CPU | "
                      f"pruned {after['wall_s']:.2f} s wall / {after['cpu_s']:.2f} s CPU (search "
                      f"{after['search_s']:.2f} s, {after['confirmed']} re-timed {after['confirm_s']:.2f} s); "
                      f"{after['searched']:,} layouts, {after['feasible']:,} fit; best "
                      f"{after['best']}{'' if same else ' (DIFFERS from unpruned)'}; load "
                      f"{before['load_avg_1m_before']} / {after['load_avg_1m_before']}")
                rows.append({"case": after["case"], "unpruned": before, "pruned": after,
                             "same_best_and_feasible": same})
    met = worst < MOE_TARGET_S
    print(f"  TARGET MoE plans < {MOE_TARGET_S:.0f} s cold: {'met' if met else 'MISSED'} (slowest {worst:.2f} s wall)")
    MOE_RESULTS.write_text(json.dumps({
        "script": "benchmarks/planner_speed.py --moe", "host": f"{os.cpu_count()} cores, shared with other jobs "
        "(load_avg_1m_before: the 1-minute load average when each run started; CPU time is the steadier number)",
        "target_s": MOE_TARGET_S, "target_met": met, "slowest_pruned_wall_s": worst, "cases": rows}, indent=2) + "\n")
    print(f"  written: {MOE_RESULTS.relative_to(Path(__file__).resolve().parents[1])}")


def cold_moe(name: str, gpus: int, batch: int, attention: str, predicted: bool, prune: bool = True) -> None:
    """One MoE plan, timed from a fresh process (imports not counted); prints one JSON line."""
    import json

    from backend.hf.config import from_hf_config, load_hf_config

    fields, _ = from_hf_config(load_hf_config(str(Path(__file__).resolve().parents[1] / "tests/fixtures/hf" /
                                                  f"{name}.json")),
                               seq_len=4096)
    model = ModelSpec(**{**fields, "seq_len": 4096, "attention": attention})
    hw = get_hardware("h100-sxm")
    w, c = time.perf_counter(), time.process_time()
    res = plan(model, gpus=gpus, gpus_per_node=NODE, hw=hw, global_batch=batch, top=10, include_predicted=predicted,
               prune=prune)
    w, c = time.perf_counter() - w, time.process_time() - c
    print(json.dumps({"case": f"{name} on {gpus} H100, {attention}{', --include-predicted' if predicted else ''}",
                      "prune": prune, "wall_s": round(w, 3), "cpu_s": round(c, 3), "searched": res.searched,
                      "feasible": res.feasible, "search_s": round(res.search_seconds, 3), "confirmed": res.confirmed,
                      "confirm_s": round(res.confirm_seconds, 3),
                      "best": res.configs[0]["spec"]["name"] if res.configs else "-"}))


def cold_plan() -> None:
    """The first `plan` in a fresh process (every Python-side cache empty; imports not counted)."""
    hw = get_hardware("h100-sxm")
    w, c = time.perf_counter(), time.process_time()
    res = plan(LLAMA70B, gpus=GPUS, gpus_per_node=NODE, hw=hw, global_batch=BATCH, top=10)
    w, c = time.perf_counter() - w, time.process_time() - c
    print(f"end-to-end plan --top 10, COLD (first call in a fresh process): {w:.3f} s wall, {c:.3f} s CPU -> "
          f"{res.searched / w:,.0f} layouts/s wall, {res.searched / c:,.0f} CPU (incl. the fixed re-timing of its "
          "pool)")


if __name__ == "__main__":
    if "--cold-plan" in sys.argv:
        cold_plan()
    elif "--cold-moe" in sys.argv:
        at = sys.argv.index("--cold-moe")
        cold_moe(sys.argv[at + 1], int(sys.argv[at + 2]), int(sys.argv[at + 3]), sys.argv[at + 4],
                 "--include-predicted" in sys.argv, prune="--no-prune" not in sys.argv)
    elif "--moe" in sys.argv:
        moe_plans()
    else:
        main()
        moe_plans()
