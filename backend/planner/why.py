"""Why #1 of a plan beats #2, in layout terms: walk from #1's layout to #2's one choice at a time (the degrees, the
data-parallel flavour, the micro-batch, the recompute policy, the pipeline schedule, sequence parallelism, a searched
capacity factor), time each layout on the way with the step-time model, and give each choice the seconds it adds; the
steps telescope, so the signed parts add up to the difference. Beside it, the same difference by part of the step
(compute, exposed communication, bubble, optimizer, other), which adds up too (steptime.model: the parts sum to the
step).
"""

from __future__ import annotations

from typing import Any

from backend.analytic.device import RuntimeOverhead, fits_device, need_bytes
from backend.analytic.estimate import worst_rank_bytes
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.steptime.model import InconsistentStepTime, step_time
from backend.spec import ExperimentSpec

MODEL_CHOICES = ("capacity_factor", "moe_pad_to_capacity")
"""The model fields a plan searches (planner/capacity.py): a layout choice kept in the spec's model."""
CHANGES = (("degrees", ("dp", "tp", "pp", "cp", "ep")), ("flavour", ("strategy",)), ("micro-batch", ("micro_batch",)),
           ("recompute", ("recompute",)), ("schedule", ("pp_schedule", "virtual_stages")),
           ("sequence parallel", ("sequence_parallel",)), ("capacity factor", MODEL_CHOICES))
"""The layout choices, in the order the walk changes them (degrees first: the others may depend on them)."""
PARTS = (("compute_s", "compute"), ("exposed_comm_s", "exposed communication"), ("bubble_s", "pipeline bubble"),
         ("optimizer_s", "optimizer step"), ("other_s", "other"))


def _section(data: dict[str, Any], key: str) -> dict[str, Any]:
    return data["model"] if key in MODEL_CHOICES else data["train"] if key in data["train"] else data["parallel"]


def _choice(data: dict[str, Any], key: str) -> Any:
    return _section(data, key).get(key)


def _set(data: dict[str, Any], key: str, value: Any) -> None:
    _section(data, key)[key] = value


def _words(name: str, first: dict[str, Any], second: dict[str, Any]) -> str:
    """'tp 8 instead of cp 8' style: what #2 has instead of #1's choice."""
    if name == "degrees":
        keys = [k for k in ("dp", "tp", "pp", "cp", "ep") if _choice(first, k) != _choice(second, k)]
        mine = " · ".join(f"{k} {_choice(second, k)}" for k in keys)
        theirs = " · ".join(f"{k} {_choice(first, k)}" for k in keys)
        return f"{mine} instead of {theirs}"
    if name == "schedule":
        return (f"{_choice(second, 'pp_schedule')} (v={_choice(second, 'virtual_stages')}) instead of "
                f"{_choice(first, 'pp_schedule')} (v={_choice(first, 'virtual_stages')})")
    if name == "sequence parallel":
        return "sequence parallel " + ("on" if _choice(second, "sequence_parallel") else "off")
    if name == "capacity factor":
        return f"{_capacity_words(second)} instead of {_capacity_words(first)}"
    key = dict(CHANGES)[name][0]
    label = {"strategy": "", "micro_batch": "micro-batch ", "recompute": "recompute "}[key]
    return f"{label}{_choice(second, key)} instead of {label}{_choice(first, key)}"


def _capacity_words(data: dict[str, Any]) -> str:
    factor = _choice(data, "capacity_factor")
    return "dropless" if factor is None else f"capacity factor {factor:g}" + (
        " padded" if _choice(data, "moe_pad_to_capacity") else "")


def _timed(data: dict[str, Any], hw: Hardware, gpus_per_node: int) -> tuple[float, int, Any] | None:
    """(step seconds, worst-rank bytes, spec) of a layout on the walk, None where it is not a valid layout."""
    try:
        spec = ExperimentSpec.for_prediction(data)
        return step_time(spec, hw, gpus_per_node=gpus_per_node).summary["step_s"], worst_rank_bytes(spec)[0], spec
    except (ValueError, InconsistentStepTime):
        return None


def explain_first(configs: list[dict[str, Any]], hw: Hardware, gpus_per_node: int, device_bytes: float | None = None,
                  overhead: RuntimeOverhead | None = None) -> dict[str, Any] | None:
    """{"difference_s", "by_choice": [{"change", "seconds", "mem_bytes", "need_bytes", "fits"}], "by_part": {label:
    seconds}} of #2 against #1 (None with fewer than two). Each choice is timed on the layout the walk reaches with it
    (#1 with #2's choices so far, on #1's ranks) and its worst rank checked against `device_bytes` by the plan's fit
    rule (analytic/device.fits_device with `overhead`): a faster layout on the way that does not fit is why #1 does
    not take that choice. A choice whose layout alone is not valid (SP without tp, a schedule without pp) is taken
    together with the next one."""
    if len(configs) < 2:
        return None
    first, second = configs[0]["spec"], configs[1]["spec"]
    t1, t2 = configs[0]["step_time"], configs[1]["step_time"]
    current = {"model": dict(first["model"]), "train": dict(first["train"]), "parallel": dict(first["parallel"]),
               "runtime": dict(first.get("runtime") or {})}
    start = _timed(current, hw, gpus_per_node)
    before = start[0] if start else None
    steps: list[dict[str, Any]] = []
    pending: list[str] = []
    for name, keys in CHANGES:
        if all(_choice(first, k) == _choice(second, k) for k in keys):
            continue
        for k in keys:
            _set(current, k, _choice(second, k))
        if name == "degrees":
            current["parallel"]["world_size"] = second["parallel"]["world_size"]
        pending.append(_words(name, first, second))
        after = _timed(current, hw, gpus_per_node)
        if after is None or before is None:
            continue
        device = str(after[2].runtime.device)
        steps.append({"change": "; ".join(pending), "seconds": after[0] - before, "mem_bytes": after[1],
                      "need_bytes": float(need_bytes(after[1], after[2].parallel, device, overhead)),
                      "fits": None if device_bytes is None else
                      bool(fits_device(after[1], after[2].parallel, device, device_bytes, overhead))})
        before, pending = after[0], []
    if pending or before is None:  # the walk ended on a layout it could not time: one step for what is left
        steps.append({"change": "; ".join(pending) or "the layout", "seconds": t2["step_s"] - t1["step_s"]
                      - sum(s["seconds"] for s in steps), "mem_bytes": None, "need_bytes": None, "fits": None})
    return {"difference_s": t2["step_s"] - t1["step_s"], "by_choice": steps, "device_bytes": device_bytes,
            "by_part": {label: t2[key] - t1[key] for key, label in PARTS}}


def rounded_parts(values: list[float], decimals: int, total: float) -> list[float]:
    """Each value rounded to `decimals` so that the rounded parts add up to `total` (already rounded to `decimals`:
    what a reader adds up on screen): floors, then one unit more where the remainders are largest."""
    scale = 10 ** decimals
    floors = [int((v * scale) // 1) for v in values]
    extra = round(total * scale) - sum(floors)
    order = sorted(range(len(values)), key=lambda i: values[i] * scale - floors[i], reverse=True)
    for i in order[:max(0, extra)]:
        floors[i] += 1
    for i in order[::-1][:max(0, -extra)]:  # the parts' exact sum a hair off the total's rounding
        floors[i] -= 1
    return [f / scale for f in floors]


def signed(values: dict[str, float], decimals: int, total: float) -> tuple[str, dict[str, float]]:
    """('a: +1.20 s, b: −0.30 s', the shown values): largest first, zeros left out, adding up to `total`."""
    names = sorted(values, key=lambda k: -abs(values[k]))
    parts = rounded_parts([values[k] for k in names], decimals, total)
    return ", ".join(f"{k}: {_s(v, decimals)}" for k, v in zip(names, parts, strict=False)
                     if v), dict(zip(names, parts, strict=False))


def _s(seconds: float, decimals: int) -> str:
    return f"{'+' if seconds >= 0 else '−'}{abs(seconds):.{decimals}f} s"


def why_text(configs: list[dict[str, Any]], why: dict[str, Any] | None) -> str | None:
    """The explanation in words: #1's step and its largest part, then #2's difference by layout choice and by part of
    the step, each list of signed seconds adding up to the difference shown."""
    if not configs:
        return None
    t = configs[0]["step_time"]
    parts = {label: t[key] for key, label in PARTS}
    top = max(parts, key=parts.get)
    text = (f"#1 is the fastest at {t['step_s']:.3g} s per step; {top} is {parts[top] / t['step_s']:.0%} of it "
            f"({parts[top]:.3g} s).")
    if why is None:
        return text
    d = why["difference_s"]
    decimals = max(0, min(4, 2 - int(f"{abs(d):e}".split("e")[1]))) if d else 2
    shown = round(d * 10 ** decimals) / 10 ** decimals
    by_choice, shown_choice = signed({s["change"]: s["seconds"] for s in why["by_choice"]}, decimals, shown)
    by_part, _ = signed(why["by_part"], decimals, shown)
    text += (f" #2 takes {_s(shown, decimals)} per step ({d / t['step_s']:+.1%}). In layout terms, #2 has "
             f"{by_choice} (sum {_s(shown, decimals)}). By part of the step: {by_part} (sum {_s(shown, decimals)}).")
    steps = why["by_choice"]
    for k, s in enumerate(steps[:-1]):  # a layout on the way from #1 to #2 (the last one is #2 itself)
        gained = round(sum(shown_choice[x["change"]] for x in steps[:k + 1]), decimals)  # as the reader adds them
        if s["fits"] is False and gained < 0:
            so_far = "; ".join(x["change"] for x in steps[:k + 1])
            text += (f" #1 with {so_far} (its other choices kept) would save {abs(gained):.{decimals}f} s per step, "
                     f"but needs {s['need_bytes'] / 2**30:.1f} GiB per GPU ({s['mem_bytes'] / 2**30:.1f} GiB at its "
                     "fullest moment + CUDA context, NCCL buffers and allocator slack), over the "
                     f"{why['device_bytes'] / 2**30:.1f} GiB of the device: that is why #1 does not take it.")
    return text
