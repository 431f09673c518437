"""summary.md of the GPU check: a few header lines and ONE table, a row per real run (measured next to
predicted: step time on the datasheet and on the measured profile, MFU, peak allocated / reserved against the
"fits" verdict, the worst memory category error, the trace)."""

from __future__ import annotations

from typing import Any

from backend.result import MEMORY_CATEGORIES

COLUMNS = ("run", "status", "step s", "pred. datasheet s (err %)", "pred. measured s (err %)", "MFU",
           "peak alloc GiB", "peak reserved GiB", "predicted need GiB (fits)", "worst category err %",
           "trace peak GiB (err % vs measured)")


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


def run_row(run: dict[str, Any], trace_rows: dict[str, dict[str, Any]]) -> list[str]:
    name = run.get("gpu_check", {}).get("run", "?")
    fit = run.get("memory_fit") or {}
    st = run.get("step_time") or {}
    fits = fit.get("fits")
    claim = "" if fit.get("fits_claim_ok") in (None, True) else " WRONG: reserved > device"
    return [name, str(run.get("status")), _f(run.get("step_s_median")), _pred(st.get("datasheet")),
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
    lines += ["", "err % = (measured - predicted) / predicted. Predicted need = the fullest moment + the CUDA runtime "
              "allowance (analytic/device.RuntimeOverhead), the New-experiment page's \"fits\" check."]
    return "\n".join(lines) + "\n"
