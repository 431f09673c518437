"""What a spec's stack settings contradict, and what this engine cannot run of them (pure Python; the types layer):
the cross-field checks of the settings (`stack_problems`, part of checks.derive_and_check), the prediction-only
reasons (`stack_blockers`, part of run_rules.blocking_reasons), and the two settings whose effect the prediction core
reads without a device (`loss_parallel_on`, `megatron_distributed_optimizer`), and what a stack cannot be told to
run of the layout choices (`repertoire_notes`). The registry is stacks.py."""

from __future__ import annotations

from typing import Any

from backend.recompute_policy import parse as parse_recompute
from backend.spec.choices import MEGATRON_DEFAULT_RECOMPUTE_MODULES, Stack
from backend.spec.stacks import SETTING_INFO, SETTINGS, STACKS, resolve_stack


def loss_parallel_on(spec: Any) -> bool:
    """The loss runs on vocab-sharded logits (tp > 1 and the stack's loss_parallel): no device dependence."""
    if spec.parallel.tp == 1:
        return False
    own = getattr(spec.train, "loss_parallel", None)
    if own is not None:
        return bool(own)
    return bool(STACKS[Stack(getattr(spec.train, "stack", Stack.SHARDLAB))].defaults["loss_parallel"].of(spec, "gpu"))


def megatron_distributed_optimizer(spec: Any) -> bool:
    """Megatron-Core's zero1 is its DistributedOptimizer whatever the tp / pp degrees (reduce-scatter of the grad
    buckets, all-gather of the params: distrib_optimizer.py), where this engine's dp-only zero1 is torch's
    ZeroRedundancyOptimizer (all-reduce + broadcast)."""
    return str(getattr(spec.train, "stack", "shardlab")) == "megatron" and spec.parallel.zero_stage == 1


def repertoire_notes(spec: Any) -> list[str]:
    """Where a spec asks its stack for a pipeline schedule or recompute policy the framework does not configure
    (StackEntry.layouts): predicted all the same, as ShardLab models the choice, and said."""
    entry = STACKS[Stack(getattr(spec.train, "stack", Stack.SHARDLAB))]
    r, p = entry.layouts, spec.parallel
    if r is None:
        return []
    out = []
    if p.pp > 1 and str(p.pp_schedule) not in r.schedules:
        out.append(f"stack {entry.stack} runs pp_schedule {' / '.join(r.schedules)} only, not {p.pp_schedule} "
                   f"({r.source}): predicted as ShardLab's {p.pp_schedule}, which this stack cannot be told to run")
    kind = parse_recompute(str(spec.train.recompute))[0]
    if kind not in r.recompute_kinds:
        out.append(f"stack {entry.stack} configures recompute {' / '.join(r.recompute_kinds)} only, not "
                   f"{spec.train.recompute} ({r.source}): predicted as ShardLab's policy, which this stack cannot "
                   "be told to run")
    if ddp_runs_alone(spec):
        out.append(f"stack {entry.stack} runs plain data parallel ({p.strategy}, dp {p.dp}) only alone, not beside "
                   f"{_ddp_company(spec)} ({r.ddp_alone}): predicted as ShardLab's layout, which this stack cannot be "
                   "told to run; FSDP (zero3 / fsdp) is what it runs there")
    if p.pp > 1 and p.zero_stage > r.pp_zero_stage_max:
        out.append(f"stack {entry.stack} combines pipeline parallelism with ZeRO stage <= {r.pp_zero_stage_max} "
                   f"only, not {p.strategy} (ZeRO stage {p.zero_stage}) with pp {p.pp} ({r.source}): predicted as "
                   "ShardLab's layout, which this stack cannot be told to run")
    return out


def ddp_runs_alone(spec: Any) -> bool:
    """The spec's stack runs plain data parallel only alone (Repertoire.ddp_alone) and the spec puts it beside
    ep, or beside tp / pp / cp in a dense model."""
    entry = STACKS[Stack(getattr(spec.train, "stack", Stack.SHARDLAB))]
    p = spec.parallel
    if entry.layouts is None or not entry.layouts.ddp_alone or p.zero_stage != 0 or p.dp == 1:
        return False
    return p.ep > 1 or (not spec.model.is_moe and max(p.tp, p.pp, p.cp) > 1)


def _ddp_company(spec: Any) -> str:
    """The degrees beside plain data parallel that its stack refuses (ddp_runs_alone)."""
    p = spec.parallel
    dims = ("ep",) if p.ep > 1 else ("tp", "pp", "cp")
    return ", ".join(f"{d} {getattr(p, d)}" for d in dims if getattr(p, d) > 1)


def stack_problems(spec: Any) -> list[str]:
    """What a spec's stack settings contradict (its precision, its layout), with the values."""
    t, p = spec.train, spec.parallel
    problems = _dtype_problems(t)
    if t.tp_overlap and p.tp > 1 and not p.sequence_parallel:
        problems.append(f"tp_overlap with tp={p.tp} needs sequence_parallel: it overlaps SP's all-gathers and "
                        "reduce-scatters with the matmuls they feed (Megatron asserts --tp-comm-overlap needs "
                        "--sequence-parallel, arguments.py 1441-1442; torch's async TP fuses all-gather -> matmul and "
                        "matmul -> reduce-scatter)")
    if str(t.stack) == "deepspeed" and str(spec.framework) == "jax":
        problems.append("stack=deepspeed with framework=jax: the DeepSpeed stack wraps a torch model")
    problems += [x for x in (_loss_parallel_needs_vocab_parallel(t),) if x]
    return problems + _recompute_module_problems(spec) + _ep_overlap_problems(spec)


def setting_problems(train: Any) -> list[str]:
    """What a train section's stack settings contradict whatever the layout and model (its precision, its stack): the
    part of stack_problems a plan checks once for the settings every layout holds (planner/held.py)."""
    return _dtype_problems(train) + [x for x in (_modules_need_megatron(train), _ep_overlap_needs_megatron(train),
                                                 _loss_parallel_needs_vocab_parallel(train)) if x]


def _loss_parallel_needs_vocab_parallel(t: Any) -> str | None:
    """DeepSpeed has no vocab-parallel loss: AutoTP shards lm_head by rows and all-reduces full logits (DeepSpeed
    edaa7221 module_inject/auto_tp.py 454-456, layers.py 1232-1264 LmHeadLinearAllreduce)."""
    if str(t.stack) != "deepspeed" or not t.loss_parallel:
        return None
    return ("loss_parallel=on with stack deepspeed: DeepSpeed has no vocab-parallel cross-entropy (AutoTP's lm_head "
            "is LmHeadLinearAllreduce, full logits all-reduced on every tp rank: module_inject/layers.py 1232-1264 "
            "@edaa7221); drop loss_parallel or set stack megatron / torchtitan")


def _dtype_problems(t: Any) -> list[str]:
    """The dtypes a train section sets beside its precision."""
    problems = []
    precision = str(t.precision)
    allowed = {"fp32": ("fp32",), "bf16-mixed": ("fp32", "bf16"), "fp16-mixed": ("fp32", "fp16"),
               "fp8": ("fp32", "bf16", "fp8")}[precision]
    if t.param_dtype is not None and str(t.param_dtype) not in allowed:
        problems.append(f"param_dtype={t.param_dtype} with precision={precision}: params of a {precision} run are kept "
                        f"in {' or '.join(allowed)}")
    if t.param_dtype == "none" or t.grad_reduce_dtype == "none":
        problems.append("'none' is a master_dtype only (no separate master copy); params and gradients have a dtype")
    if t.grad_reduce_dtype is not None and str(t.grad_reduce_dtype) in ("fp8",):
        problems.append("grad_reduce_dtype=fp8: gradients are reduced in fp32, bf16 or fp16")
    if t.master_dtype is not None and str(t.master_dtype) == "fp8":
        problems.append("master_dtype=fp8: master weights are fp32, bf16 or none")
    return problems


def _modules_need_megatron(t: Any) -> str | None:
    if t.recompute_modules is None or str(t.stack) == "megatron":
        return None
    return (f"recompute_modules={','.join(str(x) for x in t.recompute_modules)} is Megatron-Core's "
            f"--recompute-modules: set stack megatron (stack is {t.stack})")


def _ep_overlap_needs_megatron(t: Any) -> str | None:
    if not t.ep_overlap or str(t.stack) == "megatron":
        return None
    return f"ep_overlap is Megatron-Core's --overlap-moe-expert-parallel-comm: set stack megatron (stack is {t.stack})"


def _ep_overlap_problems(spec: Any) -> list[str]:
    """Megatron-Core's own refusals of --overlap-moe-expert-parallel-comm (transformer_config.py @d98e8a64 l.
    3002-3046) and where the setting means nothing."""
    t, p = spec.train, spec.parallel
    if not t.ep_overlap:
        return []
    if problem := _ep_overlap_needs_megatron(t):
        return [problem]
    out = []
    if p.ep == 1:
        out.append("ep_overlap hides expert-parallel all-to-alls: it needs ep > 1 (ep is 1)")
    if p.pp > 1 and p.virtual_stages == 1:
        out.append(f"ep_overlap with pp={p.pp} needs virtual pipeline stages (Megatron-Core asserts "
                   "virtual_pipeline_model_parallel_size is set when pipeline_model_parallel_size > 1)")
    if str(t.recompute) not in ("none", "selective"):
        out.append(f"ep_overlap with recompute={t.recompute}: Megatron-Core allows selective recompute only "
                   "(no full recompute, recompute method or number of layers)")
    if "moe" in [str(x) for x in t.recompute_modules or ()]:
        out.append("ep_overlap with recompute_modules moe: Megatron-Core refuses checkpointing the MoE layer")
    if str(t.precision) == "fp32":
        out.append("ep_overlap needs a bf16 or fp16 model (precision is fp32)")
    return out


def _recompute_module_problems(spec: Any) -> list[str]:
    """Megatron-Core's own refusals of `--recompute-modules` (transformer_config.py @d98e8a64 l. 1943-1973) and where
    the setting means nothing."""
    t, m = spec.train, spec.model
    modules = [str(x) for x in t.recompute_modules or ()]
    if t.recompute_modules is None:
        return []
    if problem := _modules_need_megatron(t):
        return [problem]
    if str(t.recompute) != "selective":
        return [f"recompute_modules lists what selective recompute checkpoints; recompute is {t.recompute!r}, not "
                "'selective' (Megatron reads --recompute-modules under --recompute-granularity selective only)"]
    out = []
    if "mla_up_proj" in modules and not m.is_mla:
        out.append("recompute_modules mla_up_proj needs multi-latent attention (kv_lora_rank set): Megatron-Core "
                   "refuses it otherwise")
    moe_only = [x for x in ("moe", "moe_act", "shared_experts") if x in modules]
    if moe_only and not m.is_moe:
        out.append(f"recompute_modules {', '.join(moe_only)} checkpoint MoE layers; this model has no experts")
    if "moe_act" in modules and m.is_moe and not getattr(m, "moe_grouped_gemm", False):
        out.append("recompute_modules moe_act needs moe_grouped_gemm: Megatron-Core refuses it otherwise")
    if "shared_experts" in modules and m.is_moe and not getattr(m, "shared_ffn", 0):
        out.append("recompute_modules shared_experts: this model has no shared experts")
    return out


def stack_blockers(spec: Any) -> list[str]:
    """Why this engine cannot run a spec's stack settings (prediction only): settings whose value the engine does not
    run, and dtypes other than the engine's own for the layout."""
    runner_stack = "deepspeed" if str(getattr(spec, "framework", "torch")) == "deepspeed" else "shardlab"
    if str(spec.train.stack) in ("shardlab", runner_stack) and not any(getattr(spec.train, k) is not None
                                                                       for k in SETTINGS):
        return []  # the default stack is what runs it here (framework=deepspeed: DeepSpeed's own engine)
    runner = _Runner(spec)
    r = resolve_stack(spec, "sm90")  # the device the stacks are built for: Hopper picks TE's cuDNN attention
    engine = resolve_stack(runner, "sm90")
    out = []
    for name, setting in SETTING_INFO.items():  # the values this engine runs: each setting's registry entry
        runs = setting.engine_runs
        if runs is None or (setting.tp_only and spec.parallel.tp == 1):
            continue  # every value runs, or nothing to shard or overlap over one tp rank
        if r.values[name] not in runs:
            out.append(f"{name}={_words(r.values[name])} ({r.set_by[name]}, stack {r.stack}): this engine runs "
                       f"{' / '.join(_words(v) for v in runs)} only" + (f": {setting.engine_why}"
                                                                          if setting.engine_why else ""))
    if r.values["loss_parallel"] and spec.parallel.tp > 1 and (problem := _loss_parallel_blocker(spec, runner_stack)):
        out.append(problem)
    if r.values["elementwise"] == "compiled" and (problem := _compile_blocker(spec, runner_stack)):
        out.append(problem)
    if r.values["loss_compiled"] and (problem := _compiled_loss_blocker(spec, runner_stack, r.values["loss_parallel"])):
        out.append(problem)
    dtypes = [k for k in ("param_dtype", "grad_reduce_dtype", "master_dtype") if r.values[k] != engine.values[k]]
    if dtypes:
        out.append("stack " + str(r.stack) + " keeps " + ", ".join(f"{k}={r.values[k]}" for k in dtypes)
                   + " where this engine keeps " + ", ".join(f"{engine.values[k]}" for k in dtypes)
                   + " for this layout")
    if ddp_runs_alone(spec):
        out.append(f"plain data parallel ({spec.parallel.strategy}, dp {spec.parallel.dp}) beside "
                   f"{_ddp_company(spec)}: stack {r.stack} does not run it, so its prediction does not describe what "
                   "this engine would run")
    modules = [str(x) for x in spec.train.recompute_modules or ()]
    if spec.train.recompute_modules is not None and modules != [str(m) for m in MEGATRON_DEFAULT_RECOMPUTE_MODULES]:
        out.append(f"recompute_modules={','.join(modules) or '(none)'}: this engine's selective recompute checkpoints "
                   "the attention core only (core_attn)")
    if out:  # the remedy once, after the last reason
        out[-1] += (f" (stack {r.stack}: set stack {runner.train.stack} to run this layout on this engine)"
                    if r.stack != runner.train.stack else "")
    return out


def _loss_parallel_blocker(spec: Any, runs: str) -> str | None:
    """Where this engine's loss parallel (strategies/tp.loss_context around the microbatch loop) does not reach."""
    p = spec.parallel
    if runs != "shardlab" or f"{getattr(spec, 'framework', 'torch')}" != "torch":
        return f"loss_parallel=on: {spec.framework} runs its model's own loss on full logits here"
    if p.pp > 1:
        return (f"loss_parallel=on with pp={p.pp}: this engine runs the vocab-parallel loss outside pipelining only "
                "(the pipeline schedule calls its loss_fn outside loss_parallel())")
    if p.cp > 1:
        return (f"loss_parallel=on with cp={p.cp}: this engine runs the vocab-parallel loss without context "
                "parallelism only")
    return None


SPLIT_BACKWARD_SCHEDULES = ("zero_bubble", "zbv", "dualpipev")


def _torch_engine_runs(spec: Any, runs: str) -> bool:
    """This engine's torch ranks run the layout (not the DeepSpeed or JAX runner)."""
    return runs == "shardlab" and str(getattr(spec, "framework", "torch")) == "torch"


def _compile_blocker(spec: Any, runs: str) -> str | None:
    """Where this engine's compiled blocks (strategies/compiled.py) do not run: each reason measured on torch 2.13."""
    p, m = spec.parallel, spec.model
    if not _torch_engine_runs(spec, runs):
        return f"elementwise=compiled: {spec.framework} runs its model's blocks eagerly here"
    if m.n_experts:
        return (f"elementwise=compiled with n_experts={m.n_experts}: the MoE dispatch branches on each expert's token "
                "count (models/gpt.py MoE.dispatch), a data-dependent value Dynamo cannot trace with fullgraph=True "
                "(GuardOnDataDependentSymNode)")
    if p.cp > 1:
        return (f"elementwise=compiled with cp={p.cp}: the ring attention's transfers are async collectives "
                "(strategies/ring_attention.py, async_op=True), which Dynamo does not trace ('async_op=True for "
                "distributed collectives')")
    if p.pp > 1 and str(p.pp_schedule) in SPLIT_BACKWARD_SCHEDULES:
        return (f"elementwise=compiled with pp_schedule={p.pp_schedule}: the schedule splits backward into input "
                "and weight passes with retain_graph=True, which a compiled block's backward refuses (AOTAutograd's "
                "donated buffers need retain_graph=False)")
    return None


def _compiled_loss_blocker(spec: Any, runs: str, loss_parallel: bool) -> str | None:
    """Where this engine's compiled cross-entropy (strategies/compiled.loss_function) does not run (torch 2.13)."""
    if not _torch_engine_runs(spec, runs):
        return f"loss_compiled=on: {spec.framework} runs its model's own loss eagerly here"
    if loss_parallel and spec.parallel.tp > 1:
        return (f"loss_compiled=on with loss_parallel and tp={spec.parallel.tp}: torch.compile of the cross-entropy "
                "over vocab-sharded DTensor logits under loss_parallel() gave a wrong loss in 4 of 5 launches (5.008 "
                "against eager's 4.526 on the same logits, gradients off by 0.03) and a DTensor that DTensor's "
                "dispatch refuses to detach; run it eager (--no-compile-loss) or without loss parallel")
    return None


def _words(value: Any) -> str:
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)


class _Runner:
    """A spec's parts with the stack of what runs it here and no settings: ShardLab's engine, or DeepSpeed's for
    framework=deepspeed (backend/frameworks/deepspeed keeps DeepSpeed's own dtypes)."""

    def __init__(self, spec: Any):
        self.model, self.parallel, self.framework = spec.model, spec.parallel, getattr(spec, "framework", "torch")
        self.megatron_zero1 = megatron_distributed_optimizer(spec)  # the engine runs it as Megatron's optimizer
        stack = Stack.DEEPSPEED if str(self.framework) == "deepspeed" else Stack.SHARDLAB
        self.train = spec.train.model_copy(update={"stack": stack, **{k: None for k in SETTINGS}})
