"""summary.md of the GPU check: a few header lines and ONE table, a row per real run (measured next to
predicted: step time on the datasheet and on the measured profile, MFU, peak allocated / reserved against the
"fits" verdict, the worst memory category error, the trace)."""

from __future__ import annotations

from typing import Any

from backend.gpucheck.allocator import line as allocator_line
from backend.gpucheck.power import line as power_line
from backend.result import MEMORY_CATEGORIES

COLUMNS = ("run", "status", "step s", "timed steps (min-max s)", "pred. datasheet s (err %)",
           "pred. measured s (err %)", "MFU", "peak alloc GiB", "peak reserved GiB", "predicted need GiB (fits)",
           "worst category err %", "trace peak GiB (err % vs measured)")


def _f(x: Any, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _gib(b: Any) -> str:
    return "-" if not b else f"{b / 2**30:.2f}"


def _pred(block: dict[str, Any] | None) -> str:
    block = block or {}
    if block.get("step_s") is None:
        return f"- ({str(block.get('error') or 'n/a')[:40]})"
    return f"{block['step_s']:.3f} ({_f(block.get('error_pct'), '+.1f')})"


def _worst_category(run: dict[str, Any]) -> str:
    worst = None
    for r in run.get("per_rank", []):
        for k in MEMORY_CATEGORIES:
            v = (r.get("error_pct") or {}).get(k)
            if v is not None and (worst is None or abs(v) > abs(worst[1])):
                worst = (k.removesuffix("_bytes"), v)
    return "-" if worst is None else f"{worst[0]} {worst[1]:+.1f}"


def _trace(trace_rows: dict[str, dict[str, Any]], name: str) -> str:
    tr = trace_rows.get(name)
    if not tr:
        return "-"
    if tr.get("status") != "ok" or not tr.get("per_rank"):
        return f"{tr.get('status')}: {str(tr.get('error') or '')[:50]}"
    row = tr["per_rank"][0]
    traced, measured = row["traced"].get("peak_bytes"), (row.get("measured") or {}).get("peak_bytes")
    err = (traced - measured) / measured * 100.0 if traced and measured else None
    return f"{_gib(traced)} ({_f(err, '+.1f')})"


def _steps(run: dict[str, Any]) -> str:
    steps = ((run.get("per_rank") or [{}])[0] or {}).get("step_s") or []
    return f"{len(steps)} ({min(steps):.3f}-{max(steps):.3f})" if steps else "-"


def run_row(run: dict[str, Any], trace_rows: dict[str, dict[str, Any]]) -> list[str]:
    name = run.get("gpu_check", {}).get("run", "?")
    fit = run.get("memory_fit") or {}
    st = run.get("step_time") or {}
    fits = fit.get("fits")
    claim = "" if fit.get("fits_claim_ok") in (None, True) else " WRONG: reserved > device"
    return [name, str(run.get("status")), _f(run.get("step_s_median")), _steps(run), _pred(st.get("datasheet")),
            _pred(st.get("measured_profile")), _f(run.get("mfu")), _gib(fit.get("measured_peak_allocated_bytes")),
            _gib(fit.get("measured_peak_reserved_bytes")),
            f"{_gib(fit.get('need_bytes'))} ({'-' if fits is None else 'fits' if fits else 'no'}{claim})",
            _worst_category(run), _trace(trace_rows, name)]


def render(report: dict[str, Any]) -> str:
    kit, env = report.get("kit", {}), report.get("env") or {}
    torch_facts = env.get("torch", {}) if isinstance(env, dict) else {}
    lines = [f"# ShardLab GPU check {kit.get('check_id', '')}", "",
             f"Device: {torch_facts.get('device_name', '?')} · torch {torch_facts.get('torch', '?')} · CUDA "
             f"{torch_facts.get('cuda_build', '-')} · NCCL {torch_facts.get('nccl', '-')} · nproc {kit.get('nproc')} · "
             f"budget {kit.get('budget_s')} s · profile {(report.get('profile') or {}).get('key', '-')}", "",
             "Phases: " + ", ".join(f"{k} {v.get('status')} ({v.get('seconds', 0):.0f} s)"
                                    for k, v in report.get("phases", {}).items()), ""]
    tests = report.get("tests") or {}
    if isinstance(tests, dict) and tests:
        lines += ["Tests: " + "; ".join(f"{k} {v.get('counts', v.get('status'))}" for k, v in tests.items()
                                        if isinstance(v, dict)), ""]
    trace_rows = {t.get("run"): t for t in report.get("trace") or [] if isinstance(t, dict)}
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for run in report.get("runs") or []:
        lines.append("| " + " | ".join(run_row(run, trace_rows)) + " |")
    lines += ["", "err % = (measured - predicted) / predicted. Predicted need = the fullest moment (activation peak, "
              "optimizer.step or the start of the loss's backward: analytic RankEstimate.moments) + the CUDA runtime "
              "allowance (analytic/device.RuntimeOverhead), the New-experiment page's \"fits\" check."]
    if isinstance(report.get("diag"), dict):
        lines += diag_lines(report["diag"])
    if isinstance(report.get("allocator"), list) and report["allocator"]:
        lines += ["", "Allocator slack (one 1B step at world 1; reserve = peak reserved over peak allocated, need = "
                  "the smallest per-process cap the step runs under):"]
        lines += [f"- {row.get('alloc_conf') or 'default'}: {allocator_line(row)}" for row in report["allocator"]
                  if isinstance(row, dict)]
    if isinstance(report.get("power"), dict):
        lines += ["", "Power draw and SM clock per kernel class at the GPU's own power limit: "
                  + power_line(report["power"])]
    return "\n".join(lines) + "\n"


def _mib(b: Any) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def diag_lines(diag: dict[str, Any]) -> list[str]:
    """The diag section: saved bytes of one block vs the analytic term, and the profiled step by category."""
    from backend.gpucheck.kernel_categories import CATEGORIES

    gap = diag.get("activation_gap") or {}
    lines = ["", "## Diag", "", "Parts: " + ", ".join(f"{k} {v.get('status')} ({v.get('seconds', 0):.0f} s)"
                                                       for k, v in (diag.get("parts") or {}).items()), "",
             "Saved tensors of one block (backend/gpucheck/saved_tensors.py; weight casts apart):", "",
             "| device | shape | mode | saved MiB | analytic MiB | diff % | weight casts MiB |",
             "|---|---|---|---|---|---|---|"]
    for b in gap.get("blocks", []):
        lines.append(f"| {b['device']} | {b['shape']} | {b['mode']} | {_mib(b['saved_block_bytes'])} | "
                     f"{_mib(b['analytic_block_bytes'])} | {_f(b['diff_pct'], '+.1f')} | "
                     f"{_mib(b['weight_cast_bytes'])} |")
    if gap.get("runs"):
        lines += ["", "Runs, measured - predicted activations per layer (MiB): " + ", ".join(
            f"{r['run']} {r['diff_per_layer_bytes'] / 2**20:+.1f}" for r in gap["runs"])]
    prof = diag.get("step_profile") or []
    if prof:
        head = ["run", "step s", "profiled wall s", "busy s", "idle s", *CATEGORIES]
        lines += ["", "One profiled step at world 1 (backend/gpucheck/step_profile.py), device seconds by category:",
                  "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in prof:
            if r.get("status") != "ok":
                lines.append(f"| {r.get('run')} | {r.get('status')}: {str(r.get('error'))[:80]} |")
                continue
            cats = r.get("categories", {})
            lines.append("| " + " | ".join([str(r["run"]), _f(r.get("unprofiled_step_s_median")),
                                            _f(r.get("profiled_step_wall_s")), _f(r.get("device_busy_s")),
                                            _f(r.get("idle_s"))] + [_f(cats.get(c, {}).get("seconds"))
                                                                    for c in CATEGORIES]) + " |")
        for r in prof:
            hooks = {k: v["seconds"] for k, v in (r.get("cpu_ranges") or {}).items()}
            if hooks:
                lines.append(f"\n{r['run']} CPU s in FSDP2 hooks / optimizer step: "
                             + ", ".join(f"{k} {v:.3f}" for k, v in sorted(hooks.items(), key=lambda kv: -kv[1])[:8]))
    return lines
