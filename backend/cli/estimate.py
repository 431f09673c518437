"""`python -m backend estimate`: predicted per-rank memory, traffic, bubble and FLOPs without running.

  python -m backend estimate --strategy zero3 --world 4 --layers 4            # table
  python -m backend estimate --spec S.json --json                             # one JSON object
  python -m backend estimate --params 7.5e9 --dp 64 --zero-stage 1 --precision fp16-mixed   # ZeRO paper
  python -m backend estimate --mode inference --batch 8 --context 4096 --tp 2 # weights + KV cache
  python -m backend estimate --strategy zero3 --world 1000000 --rank-offset 4096 --rank-limit 100  # a page of ranks

Ranks are predicted once per class of identical ranks; beyond --rank-limit ranks only a page is printed, with
"per_rank_page" and "rank_classes" (every distinct prediction and how many ranks share it) in the JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from typing import Any

from backend.analytic.device import TIGHT, TIGHT_REASON
from backend.analytic.estimate import estimate, estimate_raw
from backend.analytic.inference import estimate_inference
from backend.analytic.units import GB, MiB
from backend.cli import fail
from backend.cli.spec_flags import add_spec_flags, spec_from_args, strategy_of
from backend.frameworks.predicted import framework_layout, layout_line
from backend.spec.choices import ZERO_STAGE, Strategy
from backend.spec.user_text import InputError

CATEGORIES = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "other_bytes", "total_bytes")
RANK_PAGE = 1024
"""Ranks printed by default: every rank of a world up to this size, a page of a larger one."""


def add_flags(p: argparse.ArgumentParser) -> None:
    add_spec_flags(p)
    p.add_argument("--params", type=float, help="raw model size Ψ (e.g. 7.5e9): ZeRO model states only")
    p.add_argument("--mode", choices=("training", "inference"), default="training")
    p.add_argument("--batch", type=int, help="inference batch (sequences)")
    p.add_argument("--context", type=int, help="inference context length (tokens)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--rank-offset", type=int, default=0, metavar="N", help="first rank of the page printed (default 0)")
    p.add_argument("--rank-limit", type=int, default=RANK_PAGE, metavar="N",
                   help=f"ranks printed (default {RANK_PAGE}; a larger world prints a page and a per-class summary)")
    p.add_argument("--hardware", help="predict the step time on this profile (`python -m backend hardware` lists them)")
    p.add_argument("--gpus-per-node", type=int, help="node size for link tiers (default: the profile's)")
    p.add_argument("--calibration", type=int, metavar="ID", help="apply a stored calibration (`python -m backend "
                                                                 "calibrate`)")
    p.add_argument("--db", metavar="URL", help="database of --calibration (default: $SHARDLAB_DB_URL or "
                                               "<repo>/data/shardlab.db)")
    p.set_defaults(func=functools.partial(run, flags=_flags_of(p)))


def _flags_of(p: argparse.ArgumentParser) -> dict[str, tuple[str, Any]]:
    """dest -> (its flags, its default): what --params names when a flag it does not read was given."""
    out: dict[str, tuple[str, Any]] = {}
    for action in p._actions:  # argparse lists its actions nowhere public
        if action.option_strings and action.dest != "help":
            names = [out.get(action.dest, ("", None))[0], *(f for f in action.option_strings if f[:5] != "--no-")]
            out[action.dest] = ("/".join(filter(None, names)), action.default)
    return out


RAW_READS = frozenset({"params", "mode", "json", "spec_dp", "spec_world_size", "zero_stage", "spec_strategy",
                       "spec_precision", "spec_optimizer"})
"""What --params reads: Ψ, N (--dp or --world), the ZeRO stage, precision and optimizer (the ZeRO paper's inputs)."""


def run(args: argparse.Namespace, flags: dict[str, tuple[str, Any]] | None = None) -> int:
    if args.params is not None:
        return _run_raw(args, flags or {})
    spec, problems = spec_from_args(args, predict_only=True)
    if spec is None:
        return fail("invalid spec: " + "; ".join(problems))
    if args.rank_offset < 0 or args.rank_limit < 1:
        return fail(f"--rank-offset must be >= 0 and --rank-limit >= 1 (got {args.rank_offset}, {args.rank_limit})")
    if args.rank_offset >= spec.parallel.world_size:
        return fail(f"--rank-offset {args.rank_offset} is past the last rank ({spec.parallel.world_size - 1})")
    if args.mode == "inference":
        batch = args.batch if args.batch is not None else spec.train.micro_batch
        context = args.context if args.context is not None else spec.model.seq_len
        if batch < 1 or context < 1:
            return fail(f"--batch and --context must be >= 1 (got batch={batch}, context={context})")
        return _emit(args, estimate_inference(spec, batch=batch, context=context, offset=args.rank_offset,
                                              max_ranks=args.rank_limit), _inference_table)
    if args.batch is not None or args.context is not None:
        return fail("--batch/--context apply to --mode inference; training uses --global-batch/--micro-batch/--seq")
    from backend.analytic.device import profile_device
    from backend.calibration.records import resolve
    from backend.engine.device_facts import host_device  # `auto` resolved as the engine would on this host
    from backend.spec.checks import run_blockers
    from backend.spec.stacks import resolve_stack

    profile = None
    if args.hardware or args.calibration is not None:
        if args.gpus_per_node is not None and args.gpus_per_node < 1:
            return fail(f"--gpus-per-node must be >= 1 (got {args.gpus_per_node})")
        try:
            profile = resolve(args.hardware, args.calibration, args.db)
        except ValueError as e:
            return fail(str(e))
    elif args.gpus_per_node is not None:
        return fail("--gpus-per-node needs --hardware")
    device = host_device(str(spec.runtime.device))
    if profile and profile_device(profile[0].kind) == "cuda" and str(spec.runtime.device) == "auto":
        device = "cuda"  # a GPU profile's fit, and the per-rank table beside it: CUDA ranks, not this host's
    est = estimate(spec, device=device)
    data = est.to_dict(offset=args.rank_offset, max_ranks=args.rank_limit)
    data["memory_device"] = device
    blockers = run_blockers(spec)
    data["runnable"], data["why_not"] = not blockers, "; ".join(blockers) or None
    data["stack"] = resolve_stack(spec, "cpu" if device == "cpu" else "gpu").to_json()
    if (layout := framework_layout(spec)) is not None:  # what a DeepSpeed / JAX run predicts for its own layout
        data["framework_layout"] = layout.to_dict()
    if profile:
        problem = _add_step_time(args, spec, data, profile, est)
        if problem:
            return fail(problem)
    return _emit(args, data, _training_table)


def _add_step_time(args: argparse.Namespace, spec, data: dict[str, Any], profile: tuple, est: Any) -> str | None:
    """Add "step_time" (slowest rank, steptime.model.STEP_KEYS), "step_time_detail" and "fit" (`est`, the ranks of
    the table, on the resolved profile's memory) to `data`; `profile`: calibration.records.resolve's."""
    from backend.analytic.steptime.model import InconsistentStepTime, step_time
    from backend.analytic.steptime.untimed import NotTimed
    from backend.calibration.fit import extrapolation
    from backend.spec.stacks import resolve_stack

    hw, band, cal = profile
    data["stack"] = resolve_stack(spec, hw.device_class).to_json()  # as the step time resolved it, on this profile
    data["fit"] = fit_on(est, hw)
    try:
        st = step_time(spec, hw, gpus_per_node=args.gpus_per_node, band=band)
    except NotTimed as e:  # no number rather than a wrong one: "step_time" is null, the detail says why
        data["step_time"], data["step_time_detail"] = None, {"hardware": hw.key, "not_timed": str(e)}
        return None
    except InconsistentStepTime as e:  # a failed internal check, named, never a traceback
        return f"the step-time model failed its own check on this layout: {e}"
    data["step_time"] = st.summary
    g = args.gpus_per_node or hw.gpus_per_node
    data["step_time_detail"] = {"hardware": hw.key, "calibration": cal["id"] if cal else None,
                                "extrapolation": extrapolation(spec, cal["ranges"], g) if cal else [],
                                "per_rank": [vars(r) for r in st.per_rank], "notes": st.notes, "caveats": st.caveats}
    return None


def fit_on(est: Any, hw: Any) -> dict[str, Any]:
    """Does the fullest rank fit the profile's GPU: its fullest moment (RankEstimate.moments, with the stack's own
    terms) + the runtime allowance (CUDA context, NCCL buffers, allocator slack; zero on CPU ranks) <= the profile's
    memory: analytic/device.fits_device, the rule the planner applies too. "verdict": fits, does not fit, or tight
    (analytic/device.fit_verdict: only the allocator slack is over the device)."""
    from backend.analytic.device import FITS, fit_verdict, runtime_overhead_bytes

    worst = max((r for r, _ in est.distinct_ranks), key=lambda r: (r.fullest_bytes(), -r.rank))
    moments = worst.moments()
    fullest = worst.fullest_bytes()
    overhead = runtime_overhead_bytes(est.spec, fullest)
    device = hw.memory_bytes
    need = fullest + overhead["total"]
    verdict = fit_verdict(fullest, est.spec.parallel, str(est.spec.runtime.device), device)
    return {"hardware": hw.key, "rank": worst.rank, "moment": max(moments, key=moments.__getitem__),
            "fullest_bytes": fullest, "overhead_bytes": overhead, "need_bytes": need, "device_bytes": device,
            "fits": verdict == FITS, "verdict": verdict}


def _run_raw(args: argparse.Namespace, flags: dict[str, tuple[str, Any]]) -> int:
    if not math.isfinite(args.params) or args.params <= 0:
        return fail(f"--params must be a positive number of parameters (got {args.params})")
    if args.mode == "inference":
        return fail("--params estimates training model states only; use a model spec for --mode inference")
    dp, problem = _raw_dp(args.spec_dp, args.spec_world_size)
    problem = _unread_by_raw(args, flags) or problem
    if problem:
        return fail(problem)
    try:
        strategy = strategy_of(args) or "ddp"
    except InputError as e:
        return fail(str(e))
    stage = ZERO_STAGE.get(Strategy(strategy))
    if stage is None:
        return fail("--params needs a data-parallel strategy (ddp, zero1..3, fsdp) or --zero-stage, got "
                    f"{args.spec_strategy}")
    out = estimate_raw(params=args.params, dp=dp, zero_stage=stage, precision=args.spec_precision or "fp16-mixed",
                       optimizer=args.spec_optimizer or "adamw")
    return _emit(args, out, _raw_table)


def _unread_by_raw(args: argparse.Namespace, flags: dict[str, tuple[str, Any]]) -> str | None:
    """The flags given that --params would silently ignore (--tp, --layers, --spec, ...), named; None when none."""
    unread = [names for dest, (names, default) in flags.items()
              if dest not in RAW_READS and getattr(args, dest, default) != default]
    if not unread:
        return None
    return (f"--params estimates ZeRO model states from Ψ, N (--dp or --world), the stage (--zero-stage or "
            f"--strategy), --precision and --optimizer only; it does not read {', '.join(unread)}: drop "
            f"{'it' if len(unread) == 1 else 'them'}, or describe the model with spec flags, not --params")


def _raw_dp(dp: int | None, world: int | None) -> tuple[int, str | None]:
    """N of the ZeRO formulas: --dp or --world (one data-parallel group, so equal when both are given), else 1."""
    for flag, n in (("--dp", dp), ("--world", world)):
        if n is not None and n < 1:
            return 0, f"{flag} must be >= 1 (got {n})"
    if dp is not None and world is not None and dp != world:
        return 0, (f"--dp {dp} contradicts --world {world}: --params models pure data parallelism, where "
                   f"N = dp = world; give one of them")
    return dp or world or 1, None


def _emit(args: argparse.Namespace, data: dict[str, Any], table) -> int:
    if args.json:
        print(json.dumps(data, sort_keys=False))
    else:
        print(table(data))
    return 0


def _fmt(n: float) -> str:
    return f"{n / GB:.2f} GB" if n >= 0.1 * GB else f"{n / MiB:.2f} MiB"


def _training_table(d: dict[str, Any]) -> str:
    cols = ("rank", "coords") + CATEGORIES
    where = {"cuda": "CUDA ranks", "cpu": "CPU ranks (for a GPU's, --hardware with a GPU profile)"}
    title = [f"memory per rank on {where.get(d.get('memory_device'), d.get('memory_device'))}"] \
        if d.get("memory_device") else []
    rows = [[str(r["rank"]), ",".join(f"{k}{v}" for k, v in r["coords"].items())] + [_fmt(r[c]) for c in CATEGORIES]
            for r in d["per_rank"]]
    head = [c.replace("_bytes", "") for c in cols]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = title + ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=False))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths, strict=False)) for row in rows]
    lines += _page_lines(d)
    lines.append(f"params_total {d['params_total']:,}  tokens/step {d['tokens_per_step']:,}  "
                 f"FLOPs/step {d['flops_per_step']:.3e}  bubble "
                 f"{d['bubble_fraction'] if d['bubble_fraction'] is not None else '-'}")
    for kind, payload in d["comm_bytes_per_step"].items():
        lines.append(f"comm {kind:>14}: payload {_fmt(payload)}/step, ring wire "
                     f"{_fmt(d['comm_wire_bytes_per_step'][kind])}/step")
    z = d["zero_textbook"]
    lines.append(f"ZeRO textbook (Ψ={z['psi']:,}, N={z['n']}, K={z['k']}, stage {z['stage']}): "
                 f"{_fmt(z['total_bytes'])} model states")
    lines += [f"note: {n}" for n in d["notes"]]
    if d.get("framework_layout"):
        lines.append(layout_line(d["framework_layout"]))
    if "stack" in d:
        st = d["stack"]
        lines.append(f"stack {st['name']} on {st['device']}: " + ", ".join(
            f"{k} {v['value']}" + ("*" if v["set_by"] != "stack default" else "") for k, v in st["settings"].items())
            + " (* set in the spec)")
    if d.get("why_not"):
        lines.append(f"prediction only (run/submit refuse it): {d['why_not']}")
    if d.get("step_time") is None and "step_time_detail" in d:
        lines.append(f"step time on {d['step_time_detail']['hardware']}: not timed: "
                     f"{d['step_time_detail']['not_timed']}")
    elif "step_time" in d:
        t, det = d["step_time"], d["step_time_detail"]
        lines.append(f"step time on {det['hardware']}"
                     f"{' (calibration ' + str(det['calibration']) + ')' if det['calibration'] else ''}: "
                     f"{t['step_s']:.4g} s [{t['low_s']:.4g}, {t['high_s']:.4g}] = compute {t['compute_s']:.4g} + "
                     "exposed comm "
                     f"{t['exposed_comm_s']:.4g} + bubble {t['bubble_s']:.4g} + optimizer {t['optimizer_s']:.4g} + "
                     f"other {t['other_s']:.4g}; {t['tokens_per_s']:.4g} tokens/s, {t['tflops_per_gpu']:.4g} TFLOP/s "
                     f"per GPU, MFU {t['mfu']:.1%}")
        lines += [f"step-time note: {c}" for c in det.get("caveats", [])]
        lines += [f"extrapolation: {x}" for x in det["extrapolation"]]
    if d.get("fit"):
        f, o = d["fit"], d["fit"]["overhead_bytes"]
        lines.append(f"fit on {f['hardware']}: rank {f['rank']} needs {_fmt(f['need_bytes'])} = fullest moment "
                     f"({f['moment']}) {_fmt(f['fullest_bytes'])} + CUDA context {_fmt(o['cuda_context'])} + NCCL "
                     f"{_fmt(o['nccl_buffers'])} + allocator slack {_fmt(o['fragmentation'])} of "
                     f"{_fmt(f['device_bytes'])}: " + f["verdict"]
                     + (f" ({TIGHT_REASON})" if f["verdict"] == TIGHT else ""))
    return "\n".join(lines)


def _page_lines(d: dict[str, Any]) -> list[str]:
    """Which ranks a paged table shows, and every class of identical ranks."""
    page = d.get("per_rank_page")
    if not page:
        return []
    last = page["offset"] + page["ranks"] - 1
    lines = [f"ranks {page['offset']}..{last} of {page['world_size']:,} shown (--rank-offset / --rank-limit); "
             f"{len(d['rank_classes'])} distinct predictions:"]
    for c in d["rank_classes"]:
        lines.append(f"  {c['ranks']:>9,} ranks like rank {c['rank']} "
                     f"({','.join(f'{k}{v}' for k, v in c['coords'].items())}): total {_fmt(c['total_bytes'])}")
    return lines


def _raw_table(d: dict[str, Any]) -> str:
    lines = [f"Ψ={d['psi']:.4g} params, N={d['n']}, K={d['k']} (params {d['param_bytes']} B, grads "
             f"{d['grad_bytes']} B)"]
    for s, v in d["by_stage"].items():
        mark = "*" if int(s) == d["stage"] else " "
        lines.append(f"{mark} ZeRO stage {s}: params {_fmt(v['params_bytes'])}  grads {_fmt(v['grads_bytes'])}  "
                     f"optimizer {_fmt(v['optimizer_bytes'])}  total {v['total_bytes'] / GB:.1f} GB per device")
    return "\n".join(lines)


def _inference_table(d: dict[str, Any]) -> str:
    lines = [f"inference: batch {d['batch']}, context {d['context']}, {d['dtype_bytes']} B/value"]
    for r in d["per_rank"]:
        lines.append(f"rank {r['rank']}: weights {_fmt(r['weights_bytes'])}  kv_cache {_fmt(r['kv_cache_bytes'])}  "
                     f"total {_fmt(r['total_bytes'])}")
    page = d.get("per_rank_page")
    if page:
        lines.append(f"ranks {page['offset']}..{page['offset'] + page['ranks'] - 1} of {page['world_size']:,} shown "
                     "(--rank-offset / --rank-limit)")
    return "\n".join(lines)
