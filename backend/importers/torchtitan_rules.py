"""torchtitan's own rules, shared by its job TOML and its Trainer.Config dump (torchtitan/train.py,
torchtitan/models/llama3/infra/parallelize.py and distributed/pipeline.py of v0.1.0 and later):
- FSDP (dp_shard != 1, default -1) shards params/grads/optimizer state; fsdp_reshard_after_forward "default"
  reshards after forward except under pipelining (then ZeRO-2), "always" = ZeRO-3, "never" = ZeRO-2;
- dp_replicate > 1 with FSDP is HSDP, which ShardLab predicts as FSDP over the whole dp group (reported);
- mixed_precision_param applies only under FSDP: DDP / TP-only training runs in fp32;
- the Llama TP plan always shards the norms over the sequence (sequence parallel) and, unless
  disable_loss_parallel, computes the loss on vocab-sharded logits (loss parallel: the spec's loss_parallel);
- the stack is torchtitan (spec/stacks.py): compile is the element-wise setting "compiled", async TP tp_overlap;
- a multi-stage pipeline schedule runs 2 stages per rank unless pipeline_parallel_layers_per_stage says otherwise;
- with pipelining, each gradient-accumulation step runs a pipeline schedule of its own (`accumulated_schedules`).
"""

from __future__ import annotations

from typing import Any

from backend.importers.fields import Flat
from backend.importers.import_result import ConfigImportError, ImportedConfig

SCHEDULES = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved1f1b": "interleaved_1f1b",
             "interleavedzerobubble": "zero_bubble", "zbvzerobubble": "zbv", "dualpipev": "dualpipev"}
MULTI_STAGE = ("interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")


def schedule(value: object) -> str:
    key = str(value).lower().replace("_", "").replace("-", "")
    if key not in SCHEDULES:
        raise ValueError("expected one of 1F1B, GPipe, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, "
                         "DualPipeV (LoopedBFS and CSV schedules are not modelled)")
    return SCHEDULES[key]


def data_parallel(flat: Flat) -> None:
    """dp_shard's default (-1), the dp flavour, HSDP, CPU offload, sequence and loss parallelism."""
    shard, replicate = flat.get("dp_shard", -1), flat.get("dp_replicate", 1)
    flat.put("dp_shard", shard, flat.source_of("dp_shard"))
    fsdp = shard != 1
    reshard = flat.get("tt_reshard", "default")
    keeps = reshard == "never" or (reshard == "default" and flat.get("pp", 1) > 1)
    flat.put("dp_flavour", ("zero2" if keeps else "zero3") if fsdp else "ddp", flat.source_of("dp_shard"))
    if fsdp and replicate != 1:
        flat.unmap(flat.source_of("dp_replicate"), replicate,
                   "HSDP (replicate x shard) is predicted as FSDP over the whole data-parallel group: ShardLab has no "
                   "hybrid sharding, so parameter, gradient and optimizer bytes per rank are predicted lower than "
                   "HSDP's")
    if flat.get("tt_cpu_offload"):
        flat.put("offload", "params", flat.source_of("tt_cpu_offload"))
    tp = flat.get("tp", 1)
    if tp > 1 and flat.get("sequence_parallel") is None:
        flat.put("sequence_parallel", True, flat.source_of("tp"))
    flat.put("stack", "torchtitan", "torchtitan job config")
    loss_parallel = flat.get("tt_loss_parallel", True) and not flat.get("tt_no_loss_parallel", False)
    source = flat.source_of("tt_no_loss_parallel") if "tt_no_loss_parallel" in flat.canonical else \
        flat.source_of("tt_loss_parallel") if "tt_loss_parallel" in flat.canonical else \
        "parallelism.disable_loss_parallel"
    flat.put("loss_parallel", bool(loss_parallel), source)  # torchtitan train.py 314-318: loss parallel whenever tp > 1


def precision(flat: Flat) -> list[str]:
    dtype = flat.get("tt_param_dtype", "bf16-mixed")
    notes = []
    if dtype == "bf16-mixed" and flat.get("dp_shard") == 1:
        dtype = "fp32"
        notes.append("mixed_precision_param applies only under FSDP in torchtitan: without dp_shard the run trains in "
                     "fp32")
    flat.put("precision", dtype, flat.source_of("tt_param_dtype"))
    if flat.get("fp8"):
        notes += _float8(flat, dtype)
    else:
        _float8_unused(flat)
    return notes


def _float8_unused(flat: Flat) -> None:
    """The float8 recipe and all-gather of a run without the float8 converter: torchtitan does not read them."""
    for key in ("tt_fp8_recipe", "tt_fp8_all_gather"):
        if flat.get(key) is not None:
            flat.ignore(flat.source_of(key), flat.get(key), "float8 settings without the float8 converter "
                        "(model.converters): torchtitan does not apply them, the run trains without float8")


FLOAT8_RECIPES = {"tensorwise": "tensorwise", "rowwise": "rowwise", "rowwise_with_gw_hp": "rowwise"}
"""torchtitan's float8.recipe_name (None: tensorwise) -> the spec's fp8_recipe."""


def _float8(flat: Flat, dtype: str) -> list[str]:
    """The float8 converter: precision fp8 (torchao float8 linears, bf16 elsewhere), its recipe and FSDP2's float8
    all-gather (float8.enable_fsdp_float8_all_gather, off by default in torchtitan)."""
    recipe = str(flat.get("tt_fp8_recipe") or "tensorwise")
    if recipe not in FLOAT8_RECIPES:
        flat.problems.append(f"float8.recipe_name={recipe!r}: expected one of {', '.join(FLOAT8_RECIPES)}")
        return []
    flat.put("precision", "fp8", flat.source_of("fp8"))
    flat.put("fp8_recipe", FLOAT8_RECIPES[recipe], flat.source_of("tt_fp8_recipe"))
    flat.put("fp8_all_gather", bool(flat.get("tt_fp8_all_gather", False)), flat.source_of("tt_fp8_all_gather"))
    if recipe == "rowwise_with_gw_hp":
        flat.unmap(flat.source_of("tt_fp8_recipe"), recipe, "rowwise with the weight gradient's GEMM in high "
                   "precision: predicted as rowwise (every float8 GEMM at the fp8 rate)")
    notes = [f"float8 converter ({recipe}): precision fp8, torchao's float8 linears (lm_head excluded, as "
             "float8.filter_fqns' default 'output'), bf16 elsewhere"]
    if dtype == "fp32":
        notes.append("float8 without FSDP: torchtitan keeps fp32 outside the float8 linears; ShardLab's fp8 runs bf16 "
                     "autocast there (activations and non-float8 GEMMs predicted in bf16)")
    return notes


def pipeline(flat: Flat, local: int, micro: int) -> list[str]:
    """Pipeline micro-batching: `local` sequences per dp rank and step in microbatches of `micro`."""
    pp = flat.get("pp", 1)
    if local % micro:
        raise ConfigImportError([f"local batch {local} is not divisible by the pipeline microbatch size {micro} "
                                 "(torchtitan refuses it too)"])
    flat.put("micro_batch", micro, "pipeline microbatch size")
    sched = flat.get("pp_schedule", "1f1b")
    flat.put("pp_schedule", sched, flat.source_of("pp_schedule"))
    if sched in MULTI_STAGE:
        flat.put("virtual_stages", _stages_per_rank(flat, pp), "parallelism.pipeline_parallel_layers_per_stage")
    return [f"pipeline microbatches per schedule = local batch {local} / microbatch size {micro} = {local // micro}"]


def accumulated_schedules(imported: ImportedConfig, flat: Flat) -> ImportedConfig:
    """Report a pipelined step that torchtitan splits into several schedules. Trainer.__init__ (torchtitan/train.py)
    sets gradient_accumulation_steps = global batch / (local batch x dp) and train_step runs forward_backward_step,
    one pp_schedule.step, per accumulation step; build_pipeline_schedule gives that schedule n_microbatches = local
    batch / pipeline_parallel_microbatch_size. The spec's microbatches are all the step's, in one schedule (no field
    holds schedules per step), so the predicted bubble is one warm-up and drain where the run pays one per schedule."""
    t, p = imported.spec["train"], imported.spec["parallel"]
    local, micro, step_microbatches = flat.get("local_batch"), t["micro_batch"], t["microbatches"]
    per_schedule = local // micro
    if p["pp"] > 1 and step_microbatches > per_schedule:
        imported.unmapped[flat.source_of("global_batch")] = {"value": t["global_batch"],
                                                             "reason": _schedules_text(t, p, local, per_schedule)}
    return imported


def _schedules_text(train: dict[str, Any], parallel: dict[str, Any], local: int, per_schedule: int) -> str:
    from backend.analytic.textbook.pipeline import bubble_fraction

    step_mb, schedules = train["microbatches"], train["microbatches"] // per_schedule
    shape = {"p": parallel["pp"], "v": parallel["virtual_stages"]}
    predicted = bubble_fraction(parallel["pp_schedule"], m=step_mb, **shape)
    runs = bubble_fraction(parallel["pp_schedule"], m=per_schedule, **shape)
    return (f"gradient accumulation x pipelining: torchtitan runs {schedules} pipeline schedules of {per_schedule} "
            f"microbatches per step (gradient accumulation steps = global batch {train['global_batch']} / (local "
            f"batch {local} x dp {parallel['dp']}) = {schedules}; n_microbatches = local batch {local} / "
            f"pipeline_parallel_microbatch_size {train['micro_batch']} = {per_schedule}), while the spec holds the "
            f"step's {step_mb} microbatches in one schedule: the bubble is predicted for {step_mb} microbatches "
            f"({parallel['pp_schedule']}, pp {shape['p']}, {shape['v']} stages per rank: {predicted:.4f} of the "
            f"step), where each of torchtitan's {schedules} schedules idles {runs:.4f} of its time ({schedules} "
            "warm-ups and drains per step, not 1)")

def _stages_per_rank(flat: Flat, pp: int) -> int:
    per_stage = flat.get("tt_layers_per_stage")
    layers = flat.get("model_base")["n_layers"]
    if per_stage is None:
        return 2
    if layers % (pp * per_stage):
        raise ConfigImportError([f"pipeline_parallel_layers_per_stage={per_stage}: {layers} layers are not pp({pp}) x "
                                 f"a whole number of stages of {per_stage} layers"])
    return layers // (pp * per_stage)


def model_compiled(flat: Flat) -> bool:
    """torchtitan compiles the blocks only with "model" among compile.components (parallelize.py
    `model_compile_enabled = compile.enable and "model" in compile.components`); no components: the default, which
    holds "model"."""
    components = flat.get("tt_compile_components")
    return bool(flat.get("tt_compile")) and (components is None or "model" in components)


def compile_and_early_step(flat: Flat) -> list[str]:
    notes: list[str] = []
    if flat.get("tt_early_step"):
        flat.unmap(flat.source_of("tt_early_step"), True, "steps and frees each gradient during backward: gradients "
                   "are predicted as if all were held until the optimizer step")
    components = flat.get("tt_compile_components")
    if model_compiled(flat):  # apply_compile: torch.compile(transformer_block, fullgraph=True) per block
        flat.put("elementwise", "compiled", flat.source_of("tt_compile"))
    elif flat.get("tt_compile"):
        notes.append(f"compile.components = {components}: without \"model\" torchtitan leaves the blocks eager "
                     "(elementwise eager)")
    if flat.get("tt_compile"):
        if components is not None:  # CompileConfig.components (configs.py 301 @b5bcd76): the loss compiles with it
            flat.put("loss_compiled", "loss" in components, "compile.components")
        elif flat.source_of("tt_compile") == "training.compile":
            notes.append("training.compile: predicted with the loss compiled too, as torchtitan does from bbb1b61 "
                         "(2025-04-02); from e8977b0 (2024-12-18) until then it left the loss eager (--no-compile-loss "
                         "describes such a run)")
        if flat.get("tt_compile_backend", "inductor") != "inductor":
            flat.unmap("compile.backend", flat.get("tt_compile_backend"), "a torch.compile backend other than "
                       "inductor: predicted as inductor's fused kernels")
    if flat.get("tp_overlap") and not model_compiled(flat):
        flat.unmap(flat.source_of("tp_overlap"), True, "async TP needs compile (torchtitan maybe_enable_async_tp "
                   "refuses it without): predicted with the overlap")
    return notes


def activation_checkpoint(flat: Flat) -> list[str]:
    """mode none | full | selective (option "op", or an integer K: every K-th block), v0.1.0 defaults selective/2."""
    mode, option = flat.get("tt_ac_mode", "selective"), str(flat.get("tt_ac_option", "2"))  # v0.1.0 defaults
    if mode == "full":
        flat.put("recompute", "full", flat.source_of("tt_ac_mode"))
    elif mode == "selective":
        if option != "op" and not option.isdigit():
            flat.problems.append(f"activation_checkpoint.selective_ac_option={option!r}: expected 'op' or a "
                                 "block count")
            return []
        policy = "op" if option == "op" else f"layers:{option}"
        flat.put("recompute", policy, flat.source_of("tt_ac_option"))
        return [f"activation checkpointing selective/{option}: recompute {policy} ("
                + ("op-level SAC with torchtitan's save list" if option == "op" else f"every {option}-th block")
                + " of each stage module)"]
    else:
        flat.put("recompute", "none", flat.source_of("tt_ac_mode"))
    return []
