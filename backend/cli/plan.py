"""`python -m backend plan`: search layouts of a model on a cluster, keep what fits, rank by predicted step time.

  python -m backend plan --layers 80 --hidden 8192 --heads 64 --kv-heads 8 --ffn 28672 --vocab 32000 \\
      --gpus 1024 --gpus-per-node 8 --hardware h100-sxm --global-batch 1024 --seq 4096 --top 5
  python -m backend plan ... --json     # {"searched", "feasible", "seconds", "configs": [{"spec", "mem_bytes_max",
                                        #   "fullest_moment", "step_time"}]}
                                        # + "search_seconds", "confirm_seconds", "screened_per_s", "confirmed", "notes"
                                        # + "none_fit" (null unless none fits: the closest layout, planner/none_fit.py)

Searches dp x tp x pp x ep x cp (flash attention only: the default on a GPU profile) x dp flavour (ddp, zero1 incl. with
TP/PP = Megatron's distributed optimizer, zero2, zero3) x micro-batch x recompute x schedule x virtual stages x SP, and
for a MoE model etp and, with --capacity-factors none,1.0,1.25, the expert capacity factor (each layout's
"capacity_factor", null = dropless; a factor drops tokens, a note says so).
Ranks only the layouts this engine runs (each config: "runnable", "why_not"); --include-predicted ranks the
prediction-only ones too, marked. A layout is priced on the profile's ranks (CUDA on a GPU profile) and fits by
`estimate --hardware`'s rule: fullest moment + CUDA context + NCCL buffers + allocator slack <= device memory
(--reserve-gb, --fragmentation override the allowance). With --spec (or `import-config --json` output) every layout
trains as that spec does: its precision (fp8 with its recipe), optimizer, and its recompute policy searched besides the
planner's own, so the spec's own layout ranks as `estimate --spec` predicts it.

A layout on which the prediction fails one of its own consistency checks (a defect of ShardLab, not of the input) is
left out of the ranking and named on stderr and in "failed_checks"; the exit code is 0 when layouts are still
reported, 1 when those failures left none.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from backend.cli import fail
from backend.spec.choices import MoeDispatcher, RecomputeModule
from backend.spec.stacks import KERNEL_CHOICES, STACK_CHOICES

MODEL_FLAGS = {"--vocab": "vocab_size", "--hidden": "d_model", "--layers": "n_layers", "--heads": "n_heads",
               "--kv-heads": "n_kv_heads", "--ffn": "ffn_hidden", "--experts": "n_experts", "--top-k": "top_k"}





def add_flags(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", help="model preset name (published shape, exact parameter count)")
    src.add_argument("--hf-config", help="Hugging Face config.json (llama, mistral, mixtral, qwen2, qwen2_moe, gpt2, "
                                         "gpt_neox, deepseek_v3, deepseek_v2, qwen3, qwen3_moe, gpt_oss, gemma3_text, "
                                         "llama4_text)")
    src.add_argument("--spec", type=Path, metavar="FILE", help="a spec JSON (or `import-config --json` output): its "
                     "model, and its GPUs, global batch and sequence length unless given")
    for flag, field in MODEL_FLAGS.items():
        p.add_argument(flag, dest=f"m_{field}", type=int, metavar="N", help=f"model.{field}")
    p.add_argument("--gpus", type=int, help="GPUs to plan for (required without --spec)")
    p.add_argument("--gpus-per-node", type=int, help="default: the hardware profile's")
    p.add_argument("--hardware", required=True, help="a profile (`python -m backend hardware`) or a calibrated "
                   "profile's name (`python -m backend calibrate --name`)")
    p.add_argument("--global-batch", type=int, help="sequences per step (required without --spec)")
    p.add_argument("--seq", type=int, help="sequence length (required without --spec)")
    p.add_argument("--memory-gb", type=float, help="device memory in GB (default: the profile's)")
    p.add_argument("--reserve-gb", type=float, help="a fixed reserve per GPU instead of the CUDA context + NCCL "
                   "buffers (default: 527 MiB context + 64 MiB per NCCL communicator, analytic/device.RuntimeOverhead)")
    p.add_argument("--fragmentation", type=float, help="allocator slack as a fraction of the fullest moment (default "
                   "0.13, measured on the H200)")
    p.add_argument("--precision", choices=("fp32", "bf16-mixed", "fp16-mixed", "fp8"),
                   help="training precision (default: the --spec's, an imported config's own, else bf16-mixed)")
    p.add_argument("--stack", choices=STACK_CHOICES,
                   help="the software stack every layout trains with (default: the --spec's, else shardlab)")
    p.add_argument("--attention-kernel", choices=KERNEL_CHOICES, help="the stack's attention kernel set on its own")
    p.add_argument("--compile", action="store_true", help="torch.compile (elementwise compiled)")
    p.add_argument("--recompute-modules", nargs="+", choices=[m.value for m in RecomputeModule], metavar="MODULE",
                   help="stack megatron: what the searched selective layouts checkpoint (Megatron-Core's "
                        "--recompute-modules; default: the --spec's, else core_attn)")
    p.add_argument("--attention", choices=("math", "flash"),
                   help="attention kernel (default: flash on a GPU profile unless the model has attention sinks, else "
                        "the model's); context parallelism is searched with flash only")
    p.add_argument("--max-cp", type=int, metavar="N", help="largest context-parallel degree searched (default 32)")
    p.add_argument("--capacity-factors", metavar="LIST",
                   help="MoE only: the expert capacity factors to search, a comma list such as none,1.0,1.25 (none = "
                        "dropless; default: the model's own). A factor drops tokens (a quality change): each layout "
                        "row carries capacity_factor and its predicted dropped share (uniform routing)")
    p.add_argument("--moe-dispatcher", choices=[d.value for d in MoeDispatcher],
                   help="MoE only: Megatron-Core's token dispatcher every layout runs (default: the model's own, "
                        "alltoall for a preset); allgather and flex (DeepEP / HybridEP) are predicted, not run here")
    p.add_argument("--calibration", type=int, metavar="ID")
    p.add_argument("--db", metavar="URL")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--include-predicted", action="store_true",
                   help="also rank layouts this engine cannot run (prediction only; each marked with why_not)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def _model(args: argparse.Namespace) -> tuple[Any, str | None]:
    from backend.spec import ModelSpec

    data: dict[str, Any] = {}
    if args.spec is not None:
        from backend.cli.spec_flags import load_spec_file
        from backend.spec.user_text import InputError

        try:
            data = dict(load_spec_file(args.spec).get("model") or {})
        except InputError as e:
            return None, str(e)
    elif args.preset or args.hf_config:
        from backend.hf.config import HFConfigError, from_hf_config, load_hf_config
        from backend.presets import preset_model

        try:
            if args.preset:
                data = preset_model(args.preset)
            else:
                data, _notes = from_hf_config(load_hf_config(args.hf_config), seq_len=args.seq,
                                              file=str(args.hf_config))
        except (KeyError, HFConfigError) as e:
            return None, str(e).strip("'\"")
    data.update({f: getattr(args, f"m_{f}") for f in MODEL_FLAGS.values() if getattr(args, f"m_{f}") is not None})
    data["seq_len"] = args.seq
    if args.moe_dispatcher is not None:
        data["moe_dispatcher"] = args.moe_dispatcher
    try:
        return ModelSpec(**data), None
    except ValueError as e:
        return None, f"invalid model: {e}"


def _from_spec(args: argparse.Namespace) -> str | None:
    """--gpus / --global-batch / --seq from --spec where not given (the spec's world, batch and sequence length)."""
    if args.spec is None:
        return None
    from backend.cli.spec_flags import load_spec_file
    from backend.spec import validate_spec
    from backend.spec.user_text import InputError

    try:
        spec, problems = validate_spec(load_spec_file(args.spec), predict_only=True)
    except InputError as e:
        return str(e)
    if spec is None:
        return f"--spec {args.spec}: " + "; ".join(problems)
    args.gpus = args.gpus or spec.parallel.world_size
    args.global_batch = args.global_batch or spec.train.global_batch
    args.seq = args.seq or spec.model.seq_len
    args.spec_train = spec.train.model_dump(mode="json")  # its precision, optimizer, recompute policy, fp8 recipe
    return None


def _capacity_factors(args: argparse.Namespace, model: Any) -> tuple[tuple[float | None, ...] | None, str | None]:
    """--capacity-factors parsed and checked against the model (dense: refused), or (None, None) without it."""
    if args.capacity_factors is None:
        return None, None
    from backend.planner.capacity import capacity_problem, parse_capacity_factors

    factors, problem = parse_capacity_factors(args.capacity_factors)
    return (None, problem) if problem else (factors, capacity_problem(model, factors))


def run(args: argparse.Namespace) -> int:
    from backend.calibration.records import resolve
    from backend.planner.allowance import allowance_problem, device_bytes_of, reserve_problem
    from backend.planner.held import HeldTraining
    from backend.planner.search import plan, planned_attention
    from backend.planner.space import Limits
    from backend.planner.why import explain_first, why_text
    from backend.spec.choices import AttentionImpl

    problem = _from_spec(args)
    if problem:
        return fail(problem)
    if args.max_cp is not None and args.max_cp < 1:
        return fail(f"--max-cp must be >= 1 (got {args.max_cp})")
    problem = allowance_problem(args.memory_gb, args.reserve_gb, args.fragmentation)  # the Plan page's check too
    if problem:
        return fail(problem)
    for name in ("gpus", "global_batch", "seq", "top"):
        if getattr(args, name) is None:
            return fail(f"--{name.replace('_', '-')} is required (or give --spec)")
        if getattr(args, name) < 1:
            return fail(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    model, problem = _model(args)
    if problem:
        return fail(problem)
    factors, problem = _capacity_factors(args, model)
    if problem:
        return fail(problem)
    if model.attn_head_dim is None and not model.is_mla and model.d_model % model.n_heads:
        return fail(f"n_heads={model.n_heads} does not divide d_model={model.d_model} ({model.d_model} % "
                    f"{model.n_heads} = {model.d_model % model.n_heads})")
    try:
        hw, band, cal = resolve(args.hardware, args.calibration, args.db)
    except ValueError as e:
        return fail(str(e))
    memory_bytes = args.memory_gb * 1e9 if args.memory_gb else None
    problem = reserve_problem(args.reserve_gb, device_bytes_of(hw, memory_bytes), args.hardware, bool(args.memory_gb))
    if problem:
        return fail(problem)
    g = args.gpus_per_node or hw.gpus_per_node
    spec_train = getattr(args, "spec_train", None)
    held = HeldTraining.of_train(spec_train, precision=args.precision, source=f"--spec {args.spec}") if spec_train \
        else HeldTraining(precision=args.precision or "bf16-mixed")
    held = held.with_stack(args.stack, {"attention_kernel": args.attention_kernel,
                                        "elementwise": "compiled" if args.compile else None,
                                        "recompute_modules": args.recompute_modules})
    if problems := held.problems():
        return fail("every layout would train with settings that contradict: " + "; ".join(problems))
    attention, why = planned_attention(model, hw, args.attention)
    attention_why = f"attention kernel: {attention} ({why})"
    model = model.model_copy(update={"attention": AttentionImpl(attention)})
    res = plan(model, gpus=args.gpus, gpus_per_node=g, hw=hw, global_batch=args.global_batch,
               memory_bytes=memory_bytes, top=args.top, held=held,
               band=band, reserve_bytes=args.reserve_gb * 1e9 if args.reserve_gb is not None else None,
               fragmentation=args.fragmentation,
               limits=Limits(max_cp=args.max_cp) if args.max_cp else Limits(), include_predicted=args.include_predicted,
               capacity_factors=factors)
    from backend.calibration.usage import calibration_used

    if res.untimed:
        return fail(f"plan cannot rank the {res.feasible} layouts that fit on {args.hardware}: {res.untimed}")
    used = calibration_used(hw, cal, res.configs, g)
    why = explain_first(res.configs, hw, g, res.device_bytes, res.overhead)
    for f in res.failed_checks:
        print(f"error: internal check failed, layout left out of the ranking: {f['why']}", file=sys.stderr)
    code = 1 if res.failed_checks and not res.configs else 0
    if args.json:
        out = res.to_dict()
        out["notes"].insert(0, attention_why)
        out["profile"] = used["profile"]
        for config, flags in zip(out["configs"], used["extrapolation"], strict=False):
            config["extrapolation"] = flags
        out["why_first"] = why  # planner/why.py: #2 against #1 by layout choice and by part, signed seconds that add up
        print(json.dumps(out))
        return code
    print(used["line"])
    print(attention_why)
    print(f"stack: {held.stack}" + (f" ({', '.join(f'{k} {v}' for k, v in held.stack_settings)})"
                                     if held.stack_settings else ""))
    print(f"searched {res.searched} layouts in {res.seconds:.2f} s ({res.screened_per_s:,.0f}/s searched); "
          f"{res.feasible} fit; the {res.confirmed} fastest re-timed with the step-time model")
    if res.none_fit is not None:  # planner/none_fit.py: the closest layout, what it lacks
        print(res.none_fit["text"])
    else:
        print(f"{'#':>2} {'layout':<40} {'b':>2} {'recompute':<9} {'schedule':<16} {'v':>1} {'SP':>2} "
              f"{'mem GiB':>7} "
              f"{'fullest at':<15} {'step s':>8} {'MFU':>6} runs")
    for i, c in enumerate(res.configs, 1):
        s, st = c["spec"], c["step_time"]
        print(f"{i:>2} {s['name'][5:]:<40} {s['train']['micro_batch']:>2} {s['train']['recompute']:<9} "
              f"{s['parallel']['pp_schedule'] if s['parallel']['pp'] > 1 else '-':<16} "
              f"{s['parallel']['virtual_stages']:>1} {'y' if s['parallel']['sequence_parallel'] else 'n':>2} "
              f"{c['mem_bytes_max'] / 2**30:>7.1f} {c['fullest_moment']:<15} {st['step_s']:>8.3f} {st['mfu']:>6.1%} "
              f"{'yes' if c['runnable'] else 'prediction only'}"
              + (" [extrapolation]" if used["extrapolation"][i - 1] else ""))
    if text := why_text(res.configs, why):
        print(text)
    for why_not in dict.fromkeys(c["why_not"] for c in res.configs if not c["runnable"]):
        print(f"prediction only: {why_not}")
    for n in res.notes:
        print(f"note: {n}")
    return code
