"""The software stacks a job trains with, one table per concept: each stack is ONE entry giving its default for every
setting, with the source that default is read from (pure Python; the types layer).

A spec names its stack (`train.stack`) and may set any setting on its own (`train.attention_kernel`, ...; None = the
stack's default), so a person can describe their own mix. `resolve_stack(spec, device)` gives every setting as it
resolves for that spec on that device class, and says for each whether the stack's default or the spec set it.
The step-time model reads the resolved kernels and overlaps (backend/analytic/steptime/model.py); the memory model
reads the dtypes and loss parallel; `estimate --json` prints the whole object as "stack".

Pinned sources (docs/ and the research notes cite the same commits):
- Megatron-LM d98e8a64ddf34856e74b24714e3bedb2f5a39553, TransformerEngine d0067d0da6cb01811b8072a7d304f0e00344ce2b;
- torchtitan 9dec370ad26b5f8e9a7333a0e36165018262644b (the 2024-12 benchmark) and
  e347b1e5e6b6941d789d16d340145294d82dc71e (the last TOML JobConfig);
- DeepSpeed edaa7221267243c7be7fb49c5d5f5c4fb97b4641; pytorch 01d5c2cc8ac53ec6f45d10e2b90f7387df1f1ac4 (_fsdp_api.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from backend.recompute_policy import KINDS
from backend.spec.choices import MEGATRON_DEFAULT_RECOMPUTE_MODULES, AttentionKernel, Elementwise, Stack, StackDtype

DEVICE_CLASSES = ("cpu", "gpu", "sm80", "sm90", "sm100", "cdna3")
"""What a setting's default may depend on: CPU ranks, a GPU of unknown generation, Ampere, Hopper, Blackwell, AMD
CDNA3 (hardware profiles carry theirs: steptime/hardware.py `Hardware.device_class`)."""
STACK_CHOICES = tuple(s.value for s in Stack)
KERNEL_CHOICES = tuple(k.value for k in AttentionKernel)
ELEMENTWISE_CHOICES = tuple(e.value for e in Elementwise)
DTYPE_CHOICES = tuple(d.value for d in StackDtype)


@dataclass(frozen=True)
class Setting:
    """How a person sets one stack setting: the CLI (spec/fields.py derives its flags) and the Stack settings form
    (dashboard/stack_form.py derives its widgets) read this entry."""

    label: str
    """The form's label."""
    flag: str
    """The CLI flag; an on / off switch (--no-<flag> turns it off) when `choices` is None."""
    choices: tuple[str, ...] | None = None
    """The values a choice setting takes; None: on / off."""
    engine_runs: tuple[str | bool, ...] | None = None
    """The values this engine runs (spec/stack_rules.stack_blockers: another value is prediction-only, with the
    reason); None: the engine runs every value the stack resolves to (dtypes: compared with the engine's own)."""
    tp_only: bool = False
    """The setting changes nothing at tp = 1 (nothing to shard or overlap over one tp rank)."""
    engine_why: str = ""
    """Why this engine runs only `engine_runs`, said with the refusal (spec/stack_rules.stack_blockers)."""

    @property
    def boolean(self) -> bool:
        return self.choices is None


SETTING_INFO: dict[str, Setting] = {
    "attention_kernel": Setting(
        "Attention kernel", "--attention-kernel", KERNEL_CHOICES, engine_runs=("eager", "flash2"),
        engine_why="its attention is torch SDPA's fused kernels as torch picks them (FlashAttention-2 on a GPU in 16 "
                   "bit) or the math kernel (models/gpt.py): it does not select cuDNN's and does not call "
                   "FlashAttention-3 or the 2022-23 libraries"),  # a CPU rank runs whatever attention the model names
    "elementwise": Setting(
        "Element-wise work (eager / compiled / fused)", "--elementwise", ELEMENTWISE_CHOICES,
        engine_runs=("eager", "compiled"),
        engine_why="fused means Transformer Engine's or Apex's CUDA kernels, which it does not call (compiled runs: "
                   "torch.compile of each block, strategies/compiled.py)"),
    "param_dtype": Setting("Parameter dtype", "--param-dtype", tuple(d for d in DTYPE_CHOICES if d != "none")),
    "grad_reduce_dtype": Setting("Gradient reduce dtype", "--grad-reduce-dtype", ("fp32", "bf16", "fp16")),
    "master_dtype": Setting("Master weights", "--master-dtype", ("fp32", "bf16", "none")),
    "loss_parallel": Setting("Loss parallel (vocab-parallel cross-entropy)", "--loss-parallel",
                             engine_runs=(False, True), tp_only=True),
    "tp_overlap": Setting(
        "TP comm overlap (async TP / TE userbuffers)", "--tp-comm-overlap", engine_runs=(False,), tp_only=True,
        engine_why="torch's async TP works on CUDA symmetric memory (torch.distributed._symmetric_memory) and TE's on "
                   "CUDA userbuffers, while this engine's TP ranks are gloo CPU ranks (the GPU check runs world 1)"),
    "grad_reduce_overlap": Setting("DP grad-reduce overlap", "--overlap-grad-reduce"),
    "param_gather_overlap": Setting("DP param-gather overlap", "--overlap-param-gather"),
    "pp_overlap": Setting("PP p2p overlap", "--pp-overlap"),
    "optimizer_over_cp": Setting("Optimizer sharded over dp x cp", "--optimizer-over-cp"),
    "ep_overlap": Setting(
        "EP all-to-all overlap (Megatron's 1F1B A2A overlap)", "--overlap-moe-expert-parallel-comm",
        engine_runs=(False,),
        engine_why="Megatron-Core's combined 1F1B schedule (pipeline_parallel/combined_1f1b.py) has no counterpart in "
                   "torch.distributed.pipelining, whose schedules this engine runs"),
    "loss_compiled": Setting("Compiled loss (torch.compile of the cross-entropy)", "--compile-loss"),
}
"""Every setting a stack gives a default for, each a `train` field of the spec of the same name: one entry here, its
default per stack in STACKS."""
SETTINGS = tuple(SETTING_INFO)
SPEC_DEFAULT = "stack default"
SPEC_SET = "set in the spec"


@dataclass(frozen=True)
class Default:
    """A stack's default for one setting: a value, or a rule over the spec and device class, and where it is read."""

    value: Any
    """The value, or a function (SpecParts, device class) -> value."""
    source: str

    def of(self, spec: Any, device: str) -> Any:
        return self.value(spec, device) if callable(self.value) else self.value


@dataclass(frozen=True)
class StackEntry:
    stack: Stack
    what: str
    defaults: dict[str, Default]
    fp8_gemms: str = "torchao"
    """Whose float8 GEMMs the stack runs under precision fp8: torchao's, or Transformer Engine's."""
    cp_ring: str = "torch"
    """Whose context-parallel ring: torch's `_templated_ring_attention`, or Transformer Engine's (analytic/traffic.py
    cp_ring_bytes, steptime/cp_ring.py, steptime/ring_compute.py)."""
    tp_overlap_impl: str = "torch"
    """Whose TP comm overlap under tp_overlap: torch's micro-pipeline TP (async TP) or Transformer Engine's userbuffers
    (steptime/tp_overlap.py: torch leaves a summed input gradient's reduce-scatter unfused)."""
    layouts: Repertoire | None = None
    """The pipeline schedules and recompute policies the framework configures; None: every one ShardLab models."""


@dataclass(frozen=True)
class Repertoire:
    """What a framework can be told to run of the layout choices ShardLab models: the planner searches only these
    under the stack, and a spec asking for another is predicted with a note saying so (stack_rules.repertoire_notes)."""

    schedules: tuple[str, ...]
    """pp_schedule values (layout.SCHEDULE_NAMES)."""
    recompute_kinds: tuple[str, ...]
    """recompute policy kinds (recompute_policy.KINDS)."""
    source: str
    pp_zero_stage_max: int = 3
    """The highest ZeRO stage the framework combines with pipeline parallelism."""
    ddp_alone: str = ""
    """Where the framework's source shows it runs plain data parallel (ZeRO stage 0, replicated parameters) over
    dp > 1 only without expert parallelism and, in a dense model, without tp, pp or cp (stack_rules.ddp_runs_alone);
    empty: plain data parallel composes with every degree."""


def _by_device(cpu: str, gpu: str, hopper: str | None = None) -> Callable[[Any, str], str]:
    """A kernel that depends on the device: CPU ranks, GPUs, and Hopper or newer (sm90, sm100) where it differs."""
    def pick(spec: Any, device: str) -> str:
        if device == "cpu":
            return cpu
        return hopper if hopper is not None and device in ("sm90", "sm100") else gpu
    return pick


def _half(spec: Any) -> str | None:
    """The 16-bit compute dtype of a precision (fp8 keeps bf16 outside its float8 GEMMs), None in fp32."""
    return {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp8": "bf16"}.get(str(spec.train.precision))


def _shardlab_params(spec: Any, device: str) -> str:
    p = spec.parallel
    half = _half(spec)
    # the engine's distributed optimizer (strategies/data_parallel.uses_distributed_optimizer): zero1 in a tp / pp / ep
    # mix, or any zero1 that the megatron stack describes (_Runner keeps that fact as `megatron_zero1`)
    megatron = str(getattr(spec.train, "stack", "shardlab")) == "megatron" or getattr(spec, "megatron_zero1", False)
    distributed_optimizer = p.zero_stage == 1 and (p.tp > 1 or p.pp > 1 or p.ep > 1 or megatron)
    return half if half and distributed_optimizer else "fp32"


def _master_if_half(params: Callable[[Any, str], str]) -> Callable[[Any, str], str]:
    return lambda spec, device: "fp32" if params(spec, device) != "fp32" else "none"


def _half_params(spec: Any, device: str) -> str:
    return _half(spec) or "fp32"


def _deepspeed_reduce(spec: Any, device: str) -> str:
    return _half(spec) or "fp32"


def _fsdp_only(spec: Any, device: str) -> bool:
    return spec.parallel.zero_stage >= 2


def _compiled(spec: Any, device: str) -> bool:
    return str(getattr(spec.train, "elementwise", None) or "eager") == "compiled"


def _deepspeed_overlap(spec: Any, device: str) -> bool:
    return spec.parallel.zero_stage == 3


ENGINE = "backend/strategies (this engine)"
STACKS: dict[Stack, StackEntry] = {e.stack: e for e in (
    StackEntry(Stack.SHARDLAB, "ShardLab's own eager-torch engine (what a run here measures)", {
        "attention_kernel": Default(_by_device("eager", "flash2"), "steptime/model.py step_time's default: the "
                                    "engine's math attention on CPU ranks, torch SDPA's FlashAttention-2 backend on "
                                    "GPUs"),
        "elementwise": Default("eager", "backend/models/gpt.py: one kernel per operator (no torch.compile, no fused "
                               "kernels); CPU profiles time it with the accounting their probe fitted "
                               "(steptime/compute.default_implementation)"),
        "param_dtype": Default(_shardlab_params, f"{ENGINE}: autocast keeps fp32 params (ddp, zero1), FSDP2's "
                               "MixedPrecisionPolicy shards fp32 params (zero2/3), the distributed optimizer (zero1 x "
                               "tp/pp, strategies/distributed_optimizer.py) keeps 16-bit params"),
        "grad_reduce_dtype": Default("fp32", f"{ENGINE}: autocast grads are fp32, FSDP2 reduce_dtype fp32, the "
                                     "distributed optimizer's main-grad buffer fp32"),
        "master_dtype": Default(_master_if_half(_shardlab_params), f"{ENGINE}: an fp32 master only where params are "
                                "16-bit (the distributed optimizer)"),
        "loss_parallel": Default(False, "strategies/tp.py: lm_head ColwiseParallel with Replicate output, the full "
                                 "logits on every tp rank"),
        "tp_overlap": Default(False, "strategies/tp.py: DTensor's TP collectives run before / after their matmuls"),
        "grad_reduce_overlap": Default(True, "DDP's bucketed all-reduce overlaps backward (Li et al. 2020 Sec 3.2.3); "
                                       "FSDP2 reduce-scatters and the distributed optimizer's bucket reduce-scatters "
                                       "run behind backward"),
        "param_gather_overlap": Default(_fsdp_only, "FSDP2 prefetches the next unit's all-gather (zero2/3); ZeRO-1's "
                                        "broadcast and the distributed optimizer's all-gather follow the step"),
        "pp_overlap": Default(False, "torch.distributed.pipelining's schedules wait on each send / recv"),
        "optimizer_over_cp": Default(True, "engine/mesh.py: the 'dp' mesh dimension is dp x cp, so ZeRO / FSDP state "
                                     "is sharded over both"),
        "ep_overlap": Default(False, "strategies/moe_dispatch.py: the engine's all-to-alls run in line with the MoE "
                              "layer"),
        "loss_compiled": Default(False, "backend/models/gpt.py: F.cross_entropy on the fp32 logits, eager"),
    }),
    StackEntry(Stack.TORCHTITAN, "pytorch/torchtitan: FSDP2, DTensor TP with loss parallel, torch.compile, torchao "
               "float8, async TP", {
        "attention_kernel": Default(_by_device("eager", "flash2"), "torchtitan models/llama3 Attention calls "
                                    "F.scaled_dot_product_attention: torch SDPA's FlashAttention-2 backend on GPUs"),
        "elementwise": Default("eager", "torchtitan JobConfig compile.enable / training.compile: off by default "
                               "(e347 job_config.py 722; 9dec370 config_manager.py 399-402)"),
        "param_dtype": Default("fp32", "torchtitan parallelize.py apply_fsdp: MixedPrecisionPolicy(param_dtype=bf16, "
                               "reduce_dtype=fp32); FSDP2 keeps the sharded params in their original fp32 (pytorch "
                               "01d5c2c _fsdp_api.py MixedPrecisionPolicy docstring); without FSDP training runs fp32"),
        "grad_reduce_dtype": Default("fp32", "training.mixed_precision_reduce, default float32 (e347 job_config.py "
                                     "290; 9dec370 config_manager.py 389)"),
        "master_dtype": Default("none", "FSDP2: 'the optimizer step uses the sharded parameter in the original dtype', "
                                "no separate master copy (_fsdp_api.py MixedPrecisionPolicy)"),
        "loss_parallel": Default(True, "torchtitan train.py 314-318: loss_parallel_enabled = tp_enabled and not "
                                 "parallelism.disable_loss_parallel (default False); 9dec370 parallel_dims.py 119-120"),
        "tp_overlap": Default(False, "parallelism.enable_async_tensor_parallel, default False (e347 job_config.py "
                              "357; 9dec370 experimental.enable_async_tensor_parallel 288)"),
        "grad_reduce_overlap": Default(True, "FSDP2 reduce-scatters each unit's grads on a separate stream behind "
                                       "backward (Zhao et al. 2023 Sec 3.3)"),
        "param_gather_overlap": Default(True, "FSDP2 prefetches the next unit's all-gather (torchtitan apply_fsdp)"),
        "pp_overlap": Default(False, "torch.distributed.pipelining's schedules wait on each send / recv"),
        "optimizer_over_cp": Default(True, "torchtitan parallel_dims.py 137: the FSDP mesh is dp_shard x cp"),
        "ep_overlap": Default(False, "torchtitan's expert parallel waits for its dispatch / combine all-to-alls inside "
                              "the MoE layer (no 1F1B overlap in JobConfig)"),
        "loss_compiled": Default(_compiled, "torchtitan compiles the loss with the model: components/loss.py "
                                 "build_cross_entropy_loss under training.compile since bbb1b61 (2025-04-02; e7c0cae), "
                                 "CompileConfig.components ['model', 'loss'] at b5bcd76 (config/configs.py 301); from "
                                 "e8977b0 (2024-12-18) to then the loss stayed eager (9dec370 train.py 136-138)"),
    }, layouts=Repertoire(
        ("1f1b", "gpipe", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"), ("none", "full", "op", "layers"),
        "torchtitan b5bcd76: pipeline_parallel_schedule is any of torch.distributed.pipelining's schedules "
        "(get_schedule_class: GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV); "
        "distributed/activation_checkpoint.py FullAC, SelectiveAC (per-op; per-layer 'K' in earlier releases, "
        "9dec370 selective_ac_option), MemoryBudgetAC (not modelled)",
        ddp_alone="plain DDP beside tp / pp / cp raises 'DDP has not supported > 1D parallelism' (torchtitan e347b1e "
        "models/llama3/infra/parallelize.py 148-151, 9dec370 parallelisms/parallelize_llama.py 106-108); ep is carved "
        "out of the FSDP mesh dp_shard x cp (e347b1e distributed/parallel_dims.py: efsdp kept whenever ep > 1)")),
    StackEntry(Stack.MEGATRON, "Megatron-Core with Transformer Engine (Megatron-LM, NeMo)", {
        "attention_kernel": Default(_by_device("eager", "flash2", hopper="cudnn"), "Megatron transformer_config.py "
                                    "151: attention_backend auto; TE attention/dot_product_attention/utils.py "
                                    "get_attention_backend 1647-1653 prefers FusedAttention (cuDNN) over flash-attn on "
                                    "compute capability >= 9.0, flash-attn below"),
        "elementwise": Default("fused", "Megatron arguments.py 2887-2905: masked-softmax, bias-dropout, RoPE, "
                               "bias-SwiGLU / GeLU fusions on by default; TE LayerNormLinear fuses the norms "
                               "(gpt_layer_specs.py get_gpt_layer_with_transformer_engine_submodules 180-340)"),
        "param_dtype": Default(_half_params, "Megatron: --bf16 / --fp16 models hold 16-bit params "
                               "(docs/user-guide/features/dist_optimizer.md table)"),
        "grad_reduce_dtype": Default("fp32", "Megatron arguments.py 1204-1217 validate_args: bf16 forces "
                                     "accumulate_allreduce_grads_in_fp32 unless --grad-reduce-in-bf16; "
                                     "param_and_grad_buffer.py group_params_for_buffers 924 (fp32 main-grad buffer)"),
        "master_dtype": Default(_master_if_half(_half_params), "Megatron distrib_optimizer.py "
                                "_build_model_and_main_param_groups 444 (fp32 shard of the main params); optimizer.py "
                                "964-1012 without the distributed optimizer"),
        "loss_parallel": Default(True, "Megatron tensor_parallel/cross_entropy.py VocabParallelCrossEntropy: the "
                                 "output layer is column-parallel over the vocabulary and the loss runs on V/tp "
                                 "logits"),
        "tp_overlap": Default(False, "Megatron model_parallel_config.py 265: tp_comm_overlap False (--tp-comm-overlap, "
                              "needs --sequence-parallel, arguments.py 1441-1442)"),
        "grad_reduce_overlap": Default(False, "Megatron arguments.py 3121: --overlap-grad-reduce, default False (one "
                                       "bucket per buffer, reduced after backward: distributed_data_parallel.py "
                                       "164-171)"),
        "param_gather_overlap": Default(False, "Megatron arguments.py 3148: --overlap-param-gather, default False"),
        "pp_overlap": Default(True, "Megatron arguments.py 3118: --no-overlap-p2p-communication clears "
                              "overlap_p2p_comm, on by default (interleaved schedules)"),
        "optimizer_over_cp": Default(True, "Megatron distributed_data_parallel.py 149 / optimizer/__init__.py "
                                     "1204-1205: the distributed optimizer's group is intra_dp_cp_group (dp x cp)"),
        "ep_overlap": Default(False, "Megatron model_parallel_config.py 343: overlap_moe_expert_parallel_comm False "
                              "(--overlap-moe-expert-parallel-comm: the combined 1F1B schedule, "
                              "pipeline_parallel/combined_1f1b.py, model_chunk_schedule_plan.py 236-303)"),
        "loss_compiled": Default(False, "Megatron runs its own VocabParallelCrossEntropy (tensor_parallel/"
                                 "cross_entropy.py), not torch.compile: its head terms are memory/stack_activations' "
                                 "megatron ones whatever this says"),
    }, fp8_gemms="transformer_engine", cp_ring="transformer_engine", tp_overlap_impl="transformer_engine",
       layouts=Repertoire(
        ("1f1b", "interleaved_1f1b"), ("none", "selective", "full", "block", "uniform"),
        "Megatron-Core d98e8a6 pipeline_parallel/schedules.py get_forward_backward_func: no pipelining, 1F1B without "
        "interleaving, or interleaved (with virtual stages), nothing else; arguments.py --recompute-granularity "
        "{full, selective} (selective: --recompute-modules), --recompute-method {uniform, block} "
        "--recompute-num-layers")),
    StackEntry(Stack.DEEPSPEED, "DeepSpeed's ZeRO engine around a torch model", {
        "attention_kernel": Default(_by_device("eager", "flash2"), "DeepSpeed keeps the model's own attention: "
                                    "ShardLab's GPT runs torch SDPA (FlashAttention-2 on GPUs)"),
        "elementwise": Default("eager", "DeepSpeed does not fuse the model's element-wise operators"),
        "param_dtype": Default(_half_params, "DeepSpeed bf16 / fp16: the module's params are 16-bit (engine.py "
                               "1978-2021; zero/stage_1_and_2.py flat bit16 groups)"),
        "grad_reduce_dtype": Default(_deepspeed_reduce, "DeepSpeed engine.py get_data_types: grad_accum_dtype "
                                     "defaults to the model dtype"),
        "master_dtype": Default(_master_if_half(_half_params), "DeepSpeed stage_1_and_2.py 490-509 "
                                "single_partition_of_fp32_groups; bf16_optimizer.py 170-196"),
        "loss_parallel": Default(False, "DeepSpeed runs the model's own loss on full logits"),
        "tp_overlap": Default(False, "DeepSpeed AutoTP runs its all-reduces after the row-parallel matmuls"),
        "grad_reduce_overlap": Default(_deepspeed_overlap, "DeepSpeed zero/config.py 383-385: overlap_comm None is "
                                       "True only for stage 3"),
        "param_gather_overlap": Default(_deepspeed_overlap, "DeepSpeed stage 3 prefetches parameters "
                                        "(stage3_prefetch_bucket_size); stages 1-2 all-gather after the step"),
        "pp_overlap": Default(False, "not modelled for DeepSpeed's pipeline engine"),
        "optimizer_over_cp": Default(True, "DeepSpeed shards over its whole data-parallel group"),
        "ep_overlap": Default(False, "DeepSpeed moe/sharded_moe.py MOELayer: its all-to-alls run in line around the "
                              "experts"),
        "loss_compiled": Default(False, "DeepSpeed runs the model's own loss eagerly"),
    }, layouts=Repertoire(
        ("1f1b", "dualpipev"), KINDS,
        "DeepSpeed 83fd8f87 deepspeed/runtime/pipe/schedule.py: PipelineEngine runs TrainSchedule (1F1B: buffers "
        "min(stages - stage_id, micro_batches)), DualPipeVEngine (pipe/dualpipev.py) DualPipeVSchedule, nothing "
        "else; pipe/engine.py PipelineEngine.__init__ asserts zero_optimization_stage() < 2 ('ZeRO-2 and ZeRO-3 are "
        "incompatible with pipeline parallelism'); recompute is the wrapped model's own (every policy)",
        pp_zero_stage_max=1)),
)}


@dataclass(frozen=True)
class ResolvedStack:
    """Every setting of a spec's stack as it resolves on a device class."""

    stack: Stack
    device: str
    values: dict[str, Any]
    set_by: dict[str, str]
    """SPEC_DEFAULT or SPEC_SET per setting."""
    sources: dict[str, str] = field(default_factory=dict)
    recompute_modules: tuple[str, ...] | None = None
    """stack megatron: what selective recompute checkpoints (train.recompute_modules; None elsewhere)."""

    @property
    def is_default(self) -> bool:
        """The shardlab stack with nothing set: what the model predicted before stacks existed."""
        return self.stack == Stack.SHARDLAB and all(v == SPEC_DEFAULT for v in self.set_by.values())

    @property
    def fp8_gemms(self) -> str:
        """Whose float8 GEMMs the stack runs under precision fp8 (StackEntry.fp8_gemms)."""
        return STACKS[self.stack].fp8_gemms

    @property
    def tp_overlap_impl(self) -> str:
        """Whose TP comm overlap the stack runs (StackEntry.tp_overlap_impl)."""
        return STACKS[self.stack].tp_overlap_impl

    @property
    def cp_ring(self) -> str:
        """Whose context-parallel ring the stack runs (StackEntry.cp_ring)."""
        return STACKS[self.stack].cp_ring

    def to_json(self) -> dict[str, Any]:
        out = {"name": str(self.stack), "what": STACKS[self.stack].what, "device": self.device,
               "settings": {k: {"value": _plain(self.values[k]), "set_by": self.set_by[k], "source": self.sources[k]}
                            for k in SETTINGS},
               "derived": {"fp8_gemms": self.fp8_gemms, "cp_ring": self.cp_ring,
                           "tp_overlap_impl": self.tp_overlap_impl}}
        return out | ({} if self.recompute_modules is None else {"recompute_modules": list(self.recompute_modules)})


def _plain(value: Any) -> Any:
    return value.value if hasattr(value, "value") else value


def resolve_stack(spec: Any, device: str = "gpu") -> ResolvedStack:
    """Every setting of the spec's stack (spec: an ExperimentSpec or its parts: model, train, parallel) on `device`
    (DEVICE_CLASSES): the spec's own value where it sets one, else the stack's default."""
    if device not in DEVICE_CLASSES:
        raise ValueError(f"device class {device!r}: expected one of {', '.join(DEVICE_CLASSES)}")
    t = spec.train
    entry = STACKS[Stack(t.stack)]
    values, set_by, sources = {}, {}, {}
    for name in SETTINGS:
        own = getattr(t, name)
        if own is not None:
            values[name], set_by[name], sources[name] = _plain(own), SPEC_SET, f"train.{name}"
        else:
            d = entry.defaults[name]
            values[name], set_by[name], sources[name] = _plain(d.of(spec, device)), SPEC_DEFAULT, d.source
    modules = getattr(t, "recompute_modules", None)
    megatron_modules = (tuple(str(m) for m in (MEGATRON_DEFAULT_RECOMPUTE_MODULES if modules is None else modules))
                        if entry.stack == Stack.MEGATRON else None)
    return ResolvedStack(stack=entry.stack, device=device, values=values, set_by=set_by, sources=sources,
                         recompute_modules=megatron_modules)
