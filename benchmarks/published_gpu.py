"""Predicted against published end-to-end GPU training step times (H100 and A100), and the real world-1 GPU-check
runs, with the step-time model as it is now and as it was before the per-device operation tables (issue 22 C), with
mean and worst |error| per stack and per GPU (issue 34).

  .venv/bin/python benchmarks/published_gpu.py [--json] [--record-before] [--breakdown N]

Every row is predicted through its spec alone (`step_time(spec, hardware)`, the stack and its settings in
`spec.train`), the same path as `python -m backend estimate --spec ROW.json --hardware HW`: no private knob. The
per-row step and memory are backend/analytic/steptime/published_check.py's, what `python -m backend published` and
the Formulas page's "Published runs" tab show a person; this script adds the GPU check's runs and the before column.
Peak memory, per stack (issue 34 part 2): `estimate` on the row's spec on CUDA ranks (memory/stack_states.py,
stack_activations.py for the non-default stacks): the predicted fullest moment of the fullest rank (the largest of
RankEstimate.moments) against the published peak reserved, and the predicted reserved = fullest + the caching
allocator's slack (analytic/device.py RuntimeOverhead.fragmentation_frac; the CUDA context and NCCL buffers are
outside torch's reserved memory). Targets (issue 34): fullest never above the published peak reserved, reserved within
10% of it, every row predicted to fit its GPU (fullest + the whole runtime allowance <= the GPU's memory). Nothing is
tuned to these numbers.

Rows: backend/analytic/steptime/published_gpu.json (each quotes its source with the URL) + Narayanan et al. 2021
Table 1 (backend/analytic/steptime/published.py); GPU check: benchmarks/results/gpu/2026-11-26-h200-run2 (5 real
runs on one H200, measured step = median of 6 timed steps); the mixture-of-experts rows (group "H100 MoE":
Megatron-Bridge's DeepSeek-V3, Qwen3-30B-A3B and GPT-OSS 120B, dgxc-benchmarking's Grok-1 314B) are summarised apart
from the dense rows and their target (issue 35). Error % = (predicted - published) / published:
negative = the model is too fast. Nothing here is fitted to these numbers: they are the test.
`--record-before` writes the "before" column's snapshot (benchmarks/results/published_gpu_before.json).
`--breakdown N` prints the step-time terms of the N worst H100 rows (seconds per step on the slowest rank).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.analytic.layout import Layout  # noqa: E402
from backend.analytic.sharding import local_params_shared  # noqa: E402
from backend.analytic.steptime.compute import attention_pass, elementwise_pass, head_pass, weights_cost  # noqa: E402
from backend.analytic.steptime.hardware import get_hardware, load_profiles  # noqa: E402
from backend.analytic.steptime.model import step_time  # noqa: E402
from backend.analytic.steptime.published_check import (  # noqa: E402
    MOE_SUFFIX,
    ErrorStats,
    memory_check,
    predicted_step_s,
)
from backend.analytic.steptime.published_gpu import published_rows  # noqa: E402
from backend.analytic.steptime.stack_knobs import stack_knobs  # noqa: E402
from backend.spec import ExperimentSpec  # noqa: E402

GPU_CHECK = ROOT / "benchmarks" / "results" / "gpu" / "2026-11-26-h200-run2" / "report.json"
BEFORE = ROOT / "benchmarks" / "results" / "published_gpu_before.json"
MEASURED_PROFILE = ROOT / "benchmarks" / "results" / "gpu" / "2026-11-26-h200-run1" / "profile.json"


def gpu_check_rows() -> list[dict]:
    """The real world-1 runs of the GPU check, predicted on the datasheet and the measured H200 profiles."""
    report = json.loads(GPU_CHECK.read_text())
    measured_key = next(iter(json.loads(MEASURED_PROFILE.read_text())["profiles"]))
    out = []
    for run in report["runs"]:
        if run.get("status") != "ok":
            continue
        name = run["gpu_check"]["run"]
        for hw in ("h200", measured_key):
            out.append({"id": f"gpu-check-{name}@{hw}", "group": "H200 (world 1)", "hardware": hw,
                        "source": "ShardLab GPU check 2026-11-26 run 2 (NVIDIA H200, torch 2.11)", "layout": name,
                        "spec": run["spec"], "stack": "shardlab", "memory_gib": None,
                        "published": run["step_time"]["measured_step_s"]})
    return out


def published() -> list[dict]:
    return [{"id": r.id, "group": r.group, "hardware": r.hardware, "source": r.source, "layout": r.layout,
             "spec": r.spec, "stack": r.stack, "memory_gib": r.memory_gib, "published": r.step_s}
            for r in published_rows()]


def rows() -> list[dict]:
    before = json.loads(BEFORE.read_text())["step_s"] if BEFORE.exists() else {}
    out = []
    for r in published() + gpu_check_rows():
        pred = predicted_step_s(r["spec"], r["hardware"])
        out.append({**{k: r[k] for k in ("id", "group", "hardware", "source", "layout", "published", "stack",
                                         "memory_gib")},
                    **memory_columns(r), "before": before.get(r["id"]), "predicted": pred,
                    "error_pct": (pred - r["published"]) / r["published"] * 100,
                    "before_error_pct": ((before[r["id"]] - r["published"]) / r["published"] * 100
                                         if r["id"] in before else None)})
    return out


def memory_prediction(spec: dict, hardware: str) -> dict:
    """The row's memory through `estimate` on CUDA ranks (published_check.memory_check): fullest moment (GiB), its
    name, predicted reserved (GiB), and whether it fits the GPU (fullest + CUDA context + NCCL buffers + allocator
    slack <= the profile's memory)."""
    m = memory_check(spec, hardware)
    return {"fullest_gib": m.fullest_gib, "moment": m.moment, "reserved_gib": m.reserved_gib, "fits": m.fits,
            "verdict": m.verdict}


def memory_columns(r: dict) -> dict:
    """The memory comparison of a row with a published peak; elsewhere whether it is predicted to fit the GPU it ran
    on (None without a GPU memory)."""
    if not r.get("memory_gib"):
        m = memory_prediction(r["spec"], r["hardware"]) if get_hardware(r["hardware"]).memory_bytes else {}
        return {"predicted_fullest_gib": None, "predicted_reserved_gib": None, "memory_error_pct": None,
                "fullest_under_published": None, "fits": m.get("fits"), "fit_verdict": m.get("verdict"),
                "fullest_moment": None}
    m = memory_prediction(r["spec"], r["hardware"])
    return {"predicted_fullest_gib": m["fullest_gib"], "predicted_reserved_gib": m["reserved_gib"],
            "memory_error_pct": (m["reserved_gib"] - r["memory_gib"]) / r["memory_gib"] * 100,
            "fullest_under_published": m["fullest_gib"] <= r["memory_gib"], "fits": m["fits"],
            "fit_verdict": m["verdict"], "fullest_moment": m["moment"]}


def _summary(data: list[dict], key: str) -> str:
    s = ErrorStats.of([r[key] for r in data if r[key] is not None])
    if s is None:
        return "-"
    return f"mean |err| {s.mean_abs_pct:5.1f}%  mean {s.mean_pct:+5.1f}%  worst {s.worst_pct:5.1f}%"


MOE = MOE_SUFFIX
"""The group suffix of mixture-of-experts rows (H100 MoE): summarised apart from the dense rows and their target."""


def _memory_cell(r: dict) -> str:
    if not r.get("memory_gib"):
        return "-"
    flag = "" if r["fullest_under_published"] else " FULLEST>PUB"
    return (f"{r['memory_gib']:.1f} / {r['predicted_fullest_gib']:.1f} / {r['predicted_reserved_gib']:.1f} "
            f"{r['memory_error_pct']:+.0f}%{flag}")


def print_table(data: list[dict]) -> None:
    print(f"{'row':50s} {'stack':10s} {'hardware':22s} {'published s':>11s} {'before s':>9s} {'err':>7s} {'now s':>9s} "
          f"{'err':>7s}  {'peak GiB: published / fullest / reserved':44s}  source")
    for r in data:
        b = f"{r['before']:9.3f} {r['before_error_pct']:+6.1f}%" if r["before"] is not None else f"{'-':>9s} {'-':>7s}"
        mem = _memory_cell(r)
        print(f"{r['id']:50s} {r['stack']:10s} {r['hardware']:22s} {r['published']:11.3f} {b} {r['predicted']:9.3f} "
              f"{r['error_pct']:+6.1f}%  {mem:44s}  {r['source']}")
    print()
    for group in dict.fromkeys(r["group"] for r in data):
        sel = [r for r in data if r["group"] == group]
        print(f"{group:16s} {len(sel):2d} rows  before: {_summary(sel, 'before_error_pct')}   now: "
              f"{_summary(sel, 'error_pct')}")
    print("\nStep time per stack and GPU (|error| of the predicted step; H100 target: mean <= 8%, worst <= 15%)")
    dense = [r for r in data if not r["group"].endswith(MOE)]
    _per_stack(dense)
    print_memory_summary(data)
    t5 = [r for r in data if r["id"].startswith("korthikanti-t5-")]
    print(f"Korthikanti 2022 Table 5 ({len(t5)} rows, stack megatron): now {_summary(t5, 'error_pct')} (bounds: mean "
          "5%, worst 10%)")
    moe = [r for r in data if r["group"].endswith(MOE)]
    print(f"\nMixture-of-experts rows ({len(moe)}, group 'H100 {MOE}': NVIDIA's MoE recipes), the same summary per "
          "stack")
    _per_stack(moe)
    specs = {r.id: r.spec for r in published_rows()}
    for r in moe:  # no published peak: the recipe ran on its GPU, so "fits" is the test (issue 34)
        m = memory_prediction(specs[r["id"]], r["hardware"])
        print(f"  {r['id']:45s} fullest {m['fullest_gib']:6.2f} GiB ({m['moment']}), predicted reserved "
              f"{m['reserved_gib']:6.2f} GiB: {'fits' if m['fits'] else 'DOES NOT FIT'} {r['hardware']}")


def _per_stack(data: list[dict]) -> None:
    for stack in dict.fromkeys(r["stack"] for r in data):
        for gpu in dict.fromkeys(r["hardware"] for r in data if r["stack"] == stack):
            sel = [r for r in data if r["stack"] == stack and r["hardware"] == gpu]
            print(f"  {stack:10s} {gpu:22s} {len(sel):3d} rows  {_summary(sel, 'error_pct')}")
        sel = [r for r in data if r["stack"] == stack and r["group"].startswith("H100")]
        if sel:
            print(f"  {stack:10s} {'all H100':22s} {len(sel):3d} rows  {_summary(sel, 'error_pct')}")


def gemm_gap(r: dict) -> dict:
    """Where the step goes for one row: the model's share of GEMMs, their efficiency (table x scale), and the GEMM
    efficiency the published step implies if every other term of the model were right."""
    spec = ExperimentSpec.for_prediction(r["spec"])
    hw = get_hardware(r["hardware"])
    step = step_time(spec, hw).summary["step_s"]
    m, t = spec.model, spec.train
    tokens = t.micro_batch * m.seq_len
    w = weights_cost(spec, hw, [q for q in local_params_shared(spec, 0) if len(q.local_shape) == 2], tokens)
    rc = 1 if str(t.recompute) == "full" else 0
    gemm_s = t.microbatches * (w.fwd_s * (1 + rc) + w.bwd_s)
    flops = t.microbatches * w.fwd_flops * (3 + rc)
    peak = hw.peak(t.precision)
    rest = step - gemm_s
    return {"gemm_share": gemm_s / step, "model_eff": flops / (gemm_s * peak),
            "implied_eff": flops / ((r["published"] - rest) * peak) if r["published"] > rest else float("nan")}


def print_gemm_gap(rows: list[dict]) -> None:
    print("\nWhy the published H100 steps are slower: per group, the model's GEMM share of the step, the GEMM "
          "efficiency"
          "\nof its table, and the GEMM efficiency the published step implies if every non-GEMM term were right")
    for group in ("H100", "A100"):
        gaps = [gemm_gap(r) for r in rows if r["group"] == group and not r["id"].startswith(("ptdp", "korthikanti"))]
        if gaps:
            print(f"  {group}: {len(gaps)} rows (FSDP, FSDP x TP), GEMM share "
                  f"{statistics.mean(g['gemm_share'] for g in gaps):.2f}, model GEMM efficiency "
                  f"{statistics.mean(g['model_eff'] for g in gaps):.3f}, implied "
                  f"{statistics.mean(g['implied_eff'] for g in gaps):.3f} (min "
                  f"{min(g['implied_eff'] for g in gaps):.3f}, max {max(g['implied_eff'] for g in gaps):.3f})")


def breakdown(r: dict) -> dict:
    """Seconds per step of one row by term: compute split into GEMMs, the attention core, element-wise kernels and
    the loss (the rest of compute: per-microbatch parameter casts, dispatch), data-parallel collectives before
    overlap and exposed, optimizer, other."""
    spec, hw = ExperimentSpec.for_prediction(r["spec"]), get_hardware(r["hardware"])
    knobs = stack_knobs(spec, hw)
    impl, attention = knobs.implementation, knobs.attention
    st = step_time(spec, hw)
    s, rank = st.summary, st.per_rank[0]
    m, t = spec.model, spec.train
    layout, rc = Layout.of(spec), 1 if str(t.recompute) == "full" else 0
    w = weights_cost(spec, hw, [q for q in local_params_shared(spec, 0) if len(q.local_shape) == 2],
                      t.micro_batch * m.seq_len // spec.parallel.cp, knobs.fp8_gemms)
    a, e = attention_pass(m, layout, hw, attention), elementwise_pass(m, layout, hw, impl)
    h = head_pass(m, layout, hw, vocab_shards=knobs.vocab_shards)
    mb, layers = t.microbatches, m.n_layers / spec.parallel.pp
    out = {"gemm": mb * (w.fwd_s * (1 + rc) + w.bwd_s), "attention": mb * layers * (a.fwd_s * (1 + rc) + a.bwd_s),
           "elementwise": mb * layers * (e.fwd_s * (1 + rc) + e.bwd_s), "loss": mb * (h.fwd_s + h.bwd_s)}
    out["compute_rest"] = s["compute_s"] - sum(out.values())
    out.update({"dp_comm": rank.comm_s["dp"], "exposed_comm": s["exposed_comm_s"], "optimizer": s["optimizer_s"],
                "other": s["other_s"], "step": s["step_s"], "published": r["published"]})
    return out


def print_breakdown(data: list[dict], rows: list[dict], n: int) -> None:
    by_id = {r["id"]: r for r in rows}
    worst = sorted((r for r in data if r["group"] == "H100"), key=lambda r: -abs(r["error_pct"]))[:n]
    keys = ("gemm", "attention", "elementwise", "loss", "compute_rest", "dp_comm", "exposed_comm", "optimizer", "other",
            "step", "published")
    print(f"\nStep-time terms of the {n} worst H100 rows (s; dp_comm before overlap, not added to the step)")
    print(f"{'row':50s} {'stack':10s} " + " ".join(f"{k[:9]:>9s}" for k in keys))
    for r in worst:
        b = breakdown(by_id[r["id"]])
        print(f"{r['id']:50s} {r['stack']:10s} " + " ".join(f"{b[k]:9.3f}" for k in keys))


def print_memory_summary(data: list[dict]) -> None:
    """Per stack and GPU: rows with a published peak reserved, how many have the predicted fullest moment at or under
    it, the predicted reserved's |error|, and how many are predicted to fit their GPU."""
    print("\nPeak memory per stack and GPU (targets: fullest <= published peak reserved; reserved = fullest + "
          "allocator slack within 10%; every row fits its GPU)")
    for stack in dict.fromkeys(r["stack"] for r in data):
        for gpu in dict.fromkeys(r["hardware"] for r in data if r["stack"] == stack):
            sel = [r for r in data if r["stack"] == stack and r["hardware"] == gpu and r.get("memory_gib")]
            if sel:
                under = sum(bool(r["fullest_under_published"]) for r in sel)
                fits = sum(bool(r["fits"]) for r in sel)
                print(f"  {stack:10s} {gpu:22s} {len(sel):3d} rows  fullest <= published {under}/{len(sel)}  "
                      f"reserved {_summary(sel, 'memory_error_pct')}  fit {fits}/{len(sel)}")
    print("Every published run predicted to fit the GPU it ran on (fullest + runtime allowance <= its memory), per "
          "stack")
    for stack in dict.fromkeys(r["stack"] for r in data):
        sel = [r for r in data if r["stack"] == stack and r["fits"] is not None]
        tight = [r["id"] for r in sel if r["fit_verdict"] == "tight"]
        misses = [r["id"] for r in sel if not r["fits"] and r["fit_verdict"] != "tight"]
        print(f"  {stack:10s} fit {len(sel) - len(misses) - len(tight)}/{len(sel)}"
              + (f"; tight (only the allocator slack over the GPU): {', '.join(tight)}" if tight else "")
              + (f"; not: {', '.join(misses)}" if misses else ""))


def record_before(data: list[dict]) -> None:
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    BEFORE.write_text(json.dumps({"_doc": f"step_s predicted by the step-time model at commit {commit}, before the "
                                          "per-device operation tables (issue 22 B); benchmarks/published_gpu.py "
                                          "--record-before",
                                  "commit": commit, "step_s": {r["id"]: r["predicted"] for r in data}}, indent=1)
                      + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--record-before", action="store_true")
    ap.add_argument("--breakdown", type=int, default=0, metavar="N", help="print the terms of the N worst H100 rows")
    args = ap.parse_args()
    os.environ.setdefault("SHARDLAB_HARDWARE", str(MEASURED_PROFILE))
    load_profiles.cache_clear() if hasattr(load_profiles, "cache_clear") else None
    t0 = time.perf_counter()
    data = rows()
    if args.record_before:
        record_before(data)
    if args.json:
        print(json.dumps(data, indent=1))
        return
    print("Predicted vs published step times; error = (predicted - published) / published, negative = too fast\n")
    print_table(data)
    print_gemm_gap(published())
    if args.breakdown:
        print_breakdown(data, published(), args.breakdown)
    print(f"\n{len(data)} predictions in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
