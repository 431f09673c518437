"""Megatron-LM's arguments -> canonical fields: one table shared by the argument list (`pretrain_gpt.py --flags`),
the "arguments" block a Megatron log starts with, and NeMo's YAML (whose model keys are the same names with
underscores, translated by importers/nemo_yaml.py).

Argument names and defaults are Megatron-LM's (megatron/training/arguments.py and TransformerConfig, 2024-2026):
add_bias_linear True (--disable-bias-linear), tied embeddings unless --untie-embeddings-and-output-weights,
position embeddings learned_absolute, LayerNorm, GELU unless --swiglu (then ffn = int(8h/3 / 64) * 64 when not
given), ffn 4h otherwise, vocabulary padded to a multiple of make_vocab_size_divisible_by (128) x tp,
attention backend "auto" (Transformer Engine's flash / fused kernels: no s x s probabilities saved).
"""

from __future__ import annotations

import ast
from typing import Any

from backend.importers.fields import Flat, Ignore, To, Unmappable, choice
from backend.importers.import_result import VOCAB_SIZE, VOCAB_UNKNOWN
from backend.importers.megatron_attention import TABLE as ATTENTION_TABLE
from backend.importers.megatron_attention import attention_shape
from backend.importers.megatron_grads import grad_dtypes
from backend.importers.megatron_moe import TABLE as MOE_TABLE
from backend.importers.megatron_moe import capacity, moe
from backend.spec.choices import RecomputeModule

_IGNORED = "training numerics, data, logging or checkpointing: no effect on memory or step time per step"
_SPEED = ("a communication-overlap or kernel option: the step-time model takes overlap and kernel efficiency from "
          "the hardware profile (a calibrated profile absorbs it)")


def as_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError("expected an integer")
    if isinstance(value, int):
        return value
    try:
        return int(str(value))
    except ValueError:
        raise ValueError("expected an integer (shell variables such as $TP are not expanded: give the "
                         "values)") from None


def pos_int(value: Any) -> int:
    n = as_int(value)
    if n < 1:
        raise ValueError("expected an integer >= 1")
    return n


def opt_int(value: Any) -> int | None:
    """An integer >= 1, or None where the printed arguments say None (unset)."""
    return None if value in (None, "None") else pos_int(value)


def as_flag(value: Any) -> bool:
    """A store_true flag (present = True) or a printed/YAML boolean."""
    if isinstance(value, bool):
        return value
    if str(value) in ("True", "False", "true", "false"):
        return str(value).lower() == "true"
    raise ValueError("expected a flag without a value, or True / False")


def literal(text: str) -> Any:
    """A value as Megatron's "arguments" block prints it (repr of the namespace value)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


TABLE: dict[str, Any] = {
    "--num-layers": To("n_layers", pos_int), "--hidden-size": To("d_model", pos_int),
    "--num-attention-heads": To("n_heads", pos_int), "--num-query-groups": To("mg_query_groups", opt_int),
    "--group-query-attention": To("mg_gqa", as_flag), "--ffn-hidden-size": To("ffn_hidden", opt_int),
    "--seq-length": To("seq_len", pos_int),
    "--max-position-embeddings": To("mg_max_positions", opt_int), "--vocab-size": To("mg_vocab", opt_int),
    "--padded-vocab-size": To("mg_padded_vocab", opt_int),
    "--make-vocab-size-divisible-by": To("mg_vocab_multiple", pos_int),
    "--swiglu": To("mg_swiglu", as_flag), "--normalization": To("norm", choice({"layernorm": "layernorm",
                                                                              "rmsnorm": "rmsnorm"})),
    "--position-embedding-type": To("positions", choice({"learned_absolute": "learned", "rope": "rope"})),
    "--untie-embeddings-and-output-weights": To("mg_untie", as_flag),
    "--disable-bias-linear": To("mg_no_bias", as_flag), "--add-bias-linear": To("mg_bias", as_flag),
    "--add-qkv-bias": To("mg_qkv_bias", as_flag),
    "--use-flash-attn": To("mg_flash", as_flag),
    "--attention-backend": To("mg_attention_backend", choice({
        **{k: k for k in ("flash", "fused", "auto", "unfused", "local")},
        **{f"attnbackend.{k}": k for k in ("flash", "fused", "auto", "unfused", "local")}})),
    "--num-experts": To("n_experts", opt_int), "--moe-router-topk": To("top_k", pos_int),
    "--moe-ffn-hidden-size": To("expert_ffn_hidden", opt_int),
    "--moe-shared-expert-intermediate-size": To("mg_shared_ffn", opt_int),
    "--micro-batch-size": To("micro_batch", pos_int), "--global-batch-size": To("global_batch", opt_int),
    "--tensor-model-parallel-size": To("tp", pos_int), "--pipeline-model-parallel-size": To("pp", pos_int),
    "--context-parallel-size": To("cp", pos_int), "--expert-model-parallel-size": To("ep", pos_int),
    "--expert-tensor-parallel-size": To("etp", opt_int),
    "--moe-expert-capacity-factor": To("capacity_factor", capacity),
    "--moe-pad-expert-input-to-capacity": To("moe_pad_to_capacity", as_flag),
    "--moe-token-dispatcher-type": To("mg_dispatcher"), "--moe-grouped-gemm": To("moe_grouped_gemm", as_flag),
    "--moe-aux-loss-coeff": To("moe_aux_loss_coeff"), "--moe-router-load-balancing-type": To("mg_lb_type"),
    "--cp-comm-type": To("mg_cp_comm", choice({"p2p": "p2p", "all_gather": "all_gather", "a2a": "a2a",
                                               "a2a+p2p": "a2a+p2p"})),
    "--num-layers-per-virtual-pipeline-stage": To("mg_layers_per_virtual", opt_int),
    "--num-virtual-stages-per-pipeline-rank": To("mg_virtual", opt_int),
    "--virtual-pipeline-model-parallel-size": To("mg_virtual", opt_int),
    "--sequence-parallel": To("sequence_parallel", as_flag),
    "--use-distributed-optimizer": To("mg_dist_opt", as_flag),
    "--use-torch-fsdp2": To("mg_fsdp", as_flag), "--use-megatron-fsdp": To("mg_fsdp", as_flag),
    "--recompute-granularity": To("mg_recompute"), "--recompute-method": To("mg_recompute_method"),
    "--recompute-num-layers": To("mg_recompute_layers", opt_int),
    "--recompute-modules": To("mg_recompute_modules"),
    "--recompute-activations": To("mg_recompute_activations", as_flag), "--bf16": To("mg_bf16", as_flag),
    "--fp16": To("mg_fp16", as_flag), "--fp8-format": To("fp8"), "--fp8": To("fp8"),
    "--fp8-recipe": To("mg_fp8_recipe"), "--params-dtype": To("mg_params_dtype"),
    "--optimizer": To("optimizer", choice({"adam": "adamw", "sgd": "sgd"})), "--world-size": To("gpus", pos_int),
    "--data-parallel-size": To("mg_dp", pos_int), "--cpu-offloading": To("mg_act_offload", as_flag),
    "--transformer-impl": To("mg_transformer_impl",
                             choice({"transformer_engine": "transformer_engine", "local": "local",
                                                           "inference_optimized": "inference_optimized"})),
    "--overlap-grad-reduce": To("grad_reduce_overlap", as_flag),
    "--overlap-param-gather": To("param_gather_overlap", as_flag),
    "--overlap-p2p-comm": To("pp_overlap", as_flag),
    "--no-overlap-p2p-communication": To("mg_no_p2p_overlap", as_flag),
    "--tp-comm-overlap": To("tp_overlap", as_flag),
    "--overlap-moe-expert-parallel-comm": To("ep_overlap", as_flag),
    "--accumulate-allreduce-grads-in-fp32": To("mg_grads_fp32", as_flag),
    "--grad-reduce-in-bf16": To("mg_grads_bf16", as_flag),
    "--main-grads-dtype": To("mg_main_grads", choice({"fp32": "fp32", "bf16": "bf16"})),
    "--main-params-dtype": To("mg_main_params", choice({"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"})),
    "--use-precision-aware-optimizer": To("mg_precision_aware", as_flag),
    "--fp8-param-gather": To("mg_fp8_params", as_flag),
    "--fp8-margin": Ignore("the fp8 scaling margin: numerics only"),
    "--fp8-interval": Ignore("the fp8 scale update interval: numerics only"),
    "--fp8-amax-history-len": Ignore("delayed scaling's amax history (a few floats per tensor): numerics only"),
    "--fp8-amax-compute-algo": Ignore("how delayed scaling reads its amax history: numerics only"),
    "--fp8-wgrad": To("mg_fp8_wgrad", as_flag),
    "--optimizer-cpu-offload": To("mg_opt_offload", as_flag),
    **MOE_TABLE,
    **ATTENTION_TABLE,
}
PREFIXES: dict[str, Any] = {
    **{p: Ignore(_IGNORED) for p in (
        "--lr", "--min-lr", "--weight-decay", "--start-weight-decay", "--end-weight-decay", "--clip-grad",
        "--adam-", "--sgd-", "--init-method", "--seed", "--train-iters", "--train-samples", "--eval-", "--log",
        "--save", "--load", "--data-", "--split", "--tokenizer", "--vocab-file", "--merge-file", "--tensorboard",
        "--wandb", "--exit-", "--timing-log", "--hidden-dropout", "--attention-dropout", "--loss-scale",
        "--initial-loss-scale", "--min-loss-scale", "--hysteresis", "--norm-epsilon", "--layernorm-epsilon",
        "--rotary-", "--rope-", "--no-", "--use-checkpoint", "--ckpt", "--dist-ckpt", "--async-save", "--num-workers",
        "--dataloader-", "--mock-data", "--distributed-backend", "--distributed-timeout", "--manual-gc",
        "--micro-batch-size-per", "--rampup-batch-size", "--decrease-batch-size", "--profile", "--record-memory",
        "--memory-snapshot", "--use-mcore-models", "--use-legacy-models", "--spec", "--local-rank",
        "--apply-query-key-layer-scaling", "--attention-softmax-in-fp32",
        "--bias-", "--masked-softmax-fusion", "--gradient-accumulation-fusion", "--apply-residual-connection",
        "--fp32-residual-connection", "--deterministic", "--check-for-nan", "--calculate-per-token-loss",
        "--log-throughput", "--iteration", "--consumed-", "--padded", "--rank",
        "--num-dataset-builder-threads", "--object-storage", "--squared-relu", "--openai-gelu", "--onnx-safe",
        "--bert", "--ict", "--titles", "--retro", "--vision", "--fp8-margin", "--fp8-interval", "--fp8-amax",
        "--first-last-layers-bf16", "--moe-z-loss",
        "--moe-input-jitter",
        "--moe-router-dtype", "--moe-router-pre-softmax", "--moe-permute-fusion",
        "--moe-token-drop",
        "--moe-router-bias-update-rate", "--moe-per-layer-logging",
        "--moe-router-topk-scaling", "--moe-use-legacy", "--use-cpu-initialization",
        "--exit", "--ft-", "--enable-ft", "--straggler", "--one-logger", "--app-tag",
        "--inprocess", "--high-priority-stream", "--nccl-", "--use-ring-exchange", "--barrier-with-l1",
        "--use-persistent-ckpt", "--non-persistent", "--finetune", "--pretrained", "--auto-detect-ckpt",
        "--wgrad-deferral", "--delay-wgrad",
        "--hierarchical-context-parallel", "--encoder-", "--decoder-first", "--decoder-last", "--use-tp-pp-dp-mapping",
        "--result-rejected", "--test-mode", "--yaml-cfg", "--heterogeneous",
        "--enable-experimental", "--full-validation", "--multiple-validation", "--skip-train",

        "--store-param-remainders", "--qk-l2-norm", "--use-rope-scaling", "--disable-",
        "--mtp-", "--te-", "--kitchen", "--group-query-attention-", "--num-layers-at-", "--account-for-",
        "--pipeline-model-parallel-layout", "--decoupled-lr", "--decoupled-min-lr", "--override-opt-param",
        "--lr-", "--weight-decay-incr-style", "--global-batch-size-ramp", "--adlr-autoresume", "--export-",
        "--num-channels", "--patch-dim", "--img-", "--dino", "--inference", "--flash-decode", "--enable-cuda-graph",
        "--cuda-graph", "--external-cuda-graph", "--wandb-", "--tensorboard-", "--log-")},
    **{p: Ignore(reason) for p, reason in (
        ("--use-pytorch-profiler", "profiling: no effect on memory or step time"),
        ("--check-weight-hash", "a consistency check, off the step"),
        ("--apply-rope-fusion", "the megatron stack's fused element-wise work already counts a fused RoPE"),
        ("--persist-layer-norm", "the megatron stack's fused element-wise work already counts fused norms"))},
    **{p: Unmappable(reason) for p, reason in (
        ("--align-grad-reduce", "when grad reductions launch across pipeline stages: not modelled"),
        ("--align-param-gather", "when param gathers launch across pipeline stages: not modelled"),
        ("--defer-embedding-wgrad", "the embedding's weight gradient deferred into the pipeline bubble: not modelled"),
        ("--batch-p2p-comm", "batched p2p send / recv: not modelled"),
        ("--tp-comm-", "Transformer Engine userbuffer tuning: the TP overlap is modelled as hiding each collective "
                       "behind the GEMMs it feeds, whatever the split or the bulk overlaps"),
        ("--bucket-size", "bucket size: the model reduces ShardLab's per-block buckets"),
        ("--use-fused", "a fused kernel beyond the stack's element-wise accounting: not modelled"),
        ("--no-persist-layer-norm", "a non-persistent norm kernel: not modelled"),
        ("--distribute-saved-activations", "checkpoints distributed over tp: not modelled"),
        ("--cross-entropy-loss-fusion", "the fused vocab-parallel cross-entropy: its memory is the unfused one's "
                                        "(core/fusions/fused_cross_entropy.py @d98e8a64 keeps the fp32 softmax and "
                                        "returns a bf16 gradient: 6 / 4 / 6 B per logit), its fewer kernels are not "
                                        "timed"),
        ("--cross-entropy-fusion-impl", "the fused cross-entropy's implementation: 'te' (TE pytorch/cross_entropy.py "
                                        "@d0067d0) computes the fp32 gradient in forward and keeps it, the same bytes "
                                        "per logit as 'native'; its kernels are not timed"),
        ("--ddp-", "DistributedDataParallelConfig tuning (bucket sizes, padding, fp32 reduce-scatter accumulation): "
                   "buffers and bucket counts not modelled"),
        ("--num-distributed-optimizer-instances", "several distributed-optimizer instances shard over dp x cp / "
                                                  "instances: predicted as one (the whole dp x cp group)"),
        ("--async-tensor-model-parallel", "the legacy async TP all-reduce overlap: not modelled"),
        ("--exp-avg", "Adam states in a lower precision (precision-aware optimizer): predicted in fp32"),
        ("--fp8-param", "an fp8 parameter option beyond --fp8-param-gather: not modelled"),
        ("--no-gradient-accumulation-fusion", "weight gradients accumulated outside the GEMM: not modelled"),
        ("--no-masked-softmax-fusion", "a fusion turned off: the fused element-wise accounting assumes it on"),
        ("--no-bias-dropout-fusion", "a fusion turned off: the fused element-wise accounting assumes it on"),
        ("--no-bias-gelu-fusion", "a fusion turned off: the fused element-wise accounting assumes it on"),
        ("--no-bias-swiglu-fusion", "a fusion turned off: the fused element-wise accounting assumes it on"),
        ("--no-rope-fusion", "a fusion turned off: the fused element-wise accounting assumes it on"),
        ("--no-fp8-wgrad", "weight-gradient GEMMs in bf16 under fp8: predicted in fp8"),
        ("--no-align-", "when DP collectives launch across pipeline stages: not modelled"),
        ("--empty-unused-memory", "torch.cuda.empty_cache() in the step: lowers reserved memory, adds time; not "
                                  "modelled"))},
    "--num-experts-per-layer": Unmappable("per-layer expert counts are not modelled"),
    "--hybrid-": Unmappable("hybrid Mamba / attention stacks are not modelled"),
}
OFF_VALUES = (None, False, "", [], 0, "None")
"""An unknown argument holding one of these in Megatron's printed "arguments" block is unset: ignored, not reported."""


def model_and_layout(flat: Flat) -> list[str]:
    """The rules that need several arguments at once; returns notes."""
    notes: list[str] = []
    h, heads, tp = flat.get("d_model"), flat.get("n_heads"), flat.get("tp", 1)
    missing = [k for k, c in (("--num-layers", "n_layers"), ("--hidden-size", "d_model"),
                              ("--num-attention-heads", "n_heads"), ("--seq-length", "seq_len")) if flat.get(c) is None]
    if missing:
        flat.problems.append(f"the arguments lack {', '.join(missing)}, which the model shape needs")
        return notes
    notes += attention_shape(flat, h, heads)
    if flat.get("mg_gqa") and flat.get("mg_query_groups"):
        flat.put("n_kv_heads", flat.get("mg_query_groups"), flat.source_of("mg_query_groups"))
    swiglu = bool(flat.get("mg_swiglu"))
    flat.put("mlp", "swiglu" if swiglu else "gelu", flat.source_of("mg_swiglu"))
    flat.canonical.pop("ffn_hidden", None) if flat.get("ffn_hidden") is None else None
    if flat.get("ffn_hidden") is None:
        ffn = int((4 * h * 2 / 3) / 64) * 64 if swiglu else 4 * h
        flat.put("ffn_hidden", ffn, "--ffn-hidden-size")
        notes.append(f"ffn hidden {ffn}: Megatron's default for {'--swiglu (int(8h/3 / 64) * 64)' if swiglu else '4h'}")
    flat.put("tie_embeddings", not flat.get("mg_untie", False), flat.source_of("mg_untie"))
    bias = flat.get("mg_bias", not flat.get("mg_no_bias", False))
    flat.put("bias", "all" if bias else ("qkv" if flat.get("mg_qkv_bias") else "none"), flat.source_of("mg_no_bias"))
    flat.put("norm", flat.get("norm", "layernorm"), flat.source_of("norm"))
    flat.put("positions", flat.get("positions", "learned"), flat.source_of("positions"))
    max_pos = flat.get("mg_max_positions")
    if flat.get("positions") == "learned" and max_pos and max_pos != flat.get("seq_len"):
        notes.append(f"learned positions: Megatron allocates --max-position-embeddings {max_pos} rows, ShardLab "
                     f"seq_len {flat.get('seq_len')} ({(max_pos - flat.get('seq_len')) * h:+,} parameters)")
    notes += _attention(flat)
    notes += _vocab(flat, tp)
    notes += moe(flat)
    notes += _context_parallel(flat)
    return notes


BACKEND_KERNELS = {"flash": "flash2", "fused": "cudnn", "unfused": "eager", "local": "eager", "auto": None}
"""--attention-backend -> the stack's attention_kernel (None: auto, Transformer Engine's choice by device:
spec/stacks.py, cuDNN fused attention on Hopper); Megatron maps the backend to NVTE_FLASH_ATTN / NVTE_FUSED_ATTN
(megatron/core/models/common/language_module/language_module.py 126-148 @d98e8a6)."""


def _attention(flat: Flat) -> list[str]:
    """The attention kernel from --transformer-impl, --attention-backend and --use-flash-attn, and the model's
    attention (flash: no (s x s) probabilities saved; math: Megatron's unfused core attention saves them)."""
    impl = flat.get("mg_transformer_impl", "transformer_engine")
    backend = flat.get("mg_attention_backend", "auto")
    source = (flat.source_of("mg_attention_backend") if "mg_attention_backend" in flat.canonical
              else "--attention-backend")
    if impl == "local" and backend == "auto":  # the local spec runs Megatron's own DotProductAttention
        kernel = "flash2" if flat.get("mg_flash") else "eager"
        source = "--use-flash-attn" if flat.get("mg_flash") else "--transformer-impl"
    else:
        kernel = BACKEND_KERNELS[backend]
    if kernel is not None:
        flat.put("attention_kernel", kernel, source)
    flat.put("attention", "math" if kernel == "eager" else "flash", source)
    shown = kernel or "Transformer Engine's choice (cuDNN fused attention on Hopper, flash-attn before)"
    return [f"attention: --transformer-impl {impl}, --attention-backend {backend} -> {shown}"]


def _context_parallel(flat: Flat) -> list[str]:
    """--cp-comm-type (default p2p): p2p passes K/V round the ring (parallel.cp_rotate alltoall, torch's ring
    send/recv), all_gather gathers them (allgather); a2a (Ulysses) and a2a+p2p split heads instead: not modelled."""
    if flat.get("cp", 1) <= 1:
        return []
    comm = flat.get("mg_cp_comm", "p2p")
    if comm in ("a2a", "a2a+p2p"):
        flat.unmap(flat.source_of("mg_cp_comm"), comm, "all-to-all (Ulysses) context parallelism splits heads, not the "
                   "ring ShardLab models; predicted as a K/V ring (p2p)")
        comm = "p2p"
    flat.put("cp_rotate", "alltoall" if comm == "p2p" else "allgather", "--cp-comm-type")
    return [f"context parallelism: --cp-comm-type {comm} -> cp_rotate {flat.get('cp_rotate')}; Megatron always "
            "balances causal work over 2 x cp chunks (cp_load_balance true)"]


def given_vocab(flat: Flat, vocab: int) -> None:
    """The vocabulary size the person importing gave (the CLI's --vocab, the dashboard's field), where the config has
    none; a contradiction with the config's own --vocab-size is a problem."""
    own = flat.get("mg_vocab")
    if own is not None and own != vocab:
        flat.problems.append(f"the vocabulary size given ({vocab:,}) contradicts the config's {own:,} "
                             f"({flat.source_of('mg_vocab')})")
    elif own is None and flat.get("mg_padded_vocab") is None:
        flat.put("mg_vocab", vocab, "the vocabulary size given on import")


def _vocab(flat: Flat, tp: int) -> list[str]:
    if flat.get("mg_padded_vocab") is not None:
        flat.put("vocab_size", flat.get("mg_padded_vocab"), flat.source_of("mg_padded_vocab"))
        return []
    vocab = flat.get("mg_vocab") or flat.get("vocab_size")
    if vocab is None:
        flat.problems.append(f"{VOCAB_UNKNOWN}: Megatron reads it from the tokenizer, which the config only names")
        flat.needs.add(VOCAB_SIZE)
        return []
    multiple = flat.get("mg_vocab_multiple", 128) * tp
    padded = -(-vocab // multiple) * multiple
    flat.put("vocab_size", padded, flat.source_of("mg_vocab"))
    return [f"vocabulary {vocab:,} padded to {padded:,} (a multiple of make-vocab-size-divisible-by "
            f"{flat.get('mg_vocab_multiple', 128)} x tp {tp}), as Megatron does"] if padded != vocab else []


def training(flat: Flat) -> list[str]:
    """Precision, optimizer sharding, recompute, the pipeline schedule and offload; returns notes."""
    notes: list[str] = []
    if flat.get("mg_bf16") and flat.get("mg_fp16"):
        flat.problems.append("--fp16 and --bf16 both given: Megatron refuses the pair (arguments.py asserts not "
                             "args.bf16 under args.fp16); give one")
    precision = "bf16-mixed" if flat.get("mg_bf16") else "fp16-mixed" if flat.get("mg_fp16") else "fp32"
    flat.put("precision", precision, "--bf16" if flat.get("mg_bf16") else "--fp16")
    fp8 = flat.get("fp8")
    if fp8 not in (None, "None", False):
        notes += _fp8(flat, fp8)
    flavour = "zero3" if flat.get("mg_fsdp") else "zero1" if flat.get("mg_dist_opt") else "ddp"
    flat.put("dp_flavour", flavour, "--use-distributed-optimizer")
    if flavour == "zero1" and (flat.get("tp", 1) > 1 or flat.get("pp", 1) > 1):
        notes.append("--use-distributed-optimizer with tp/pp: zero1, which ShardLab runs and predicts as Megatron's "
                     "distributed optimizer (16-bit params, fp32 main grads in contiguous buckets reduce-scattered "
                     "over dp x cp, fp32 masters and Adam states sharded over dp x cp, params all-gathered after the "
                     "step)")
    elif flavour == "zero1":
        notes.append("--use-distributed-optimizer without tp/pp: zero1, predicted under the megatron stack as "
                     "Megatron's distributed optimizer (grad buckets reduce-scattered, params all-gathered over dp x "
                     "cp); this engine's own dp-only zero1 is torch's ZeroRedundancyOptimizer")
    if flat.get("sequence_parallel") and flat.get("tp", 1) == 1:
        flat.put("sequence_parallel", False, flat.source_of("sequence_parallel"))
        notes.append("--sequence-parallel with tensor-model-parallel-size 1: Megatron turns it off, and so does the "
                     "spec")
    notes += _recompute(flat)
    notes += _pipeline(flat)
    notes += _stack(flat)
    for key, what in (("mg_act_offload", "activation / weight CPU offloading"),
                      ("mg_opt_offload", "optimizer CPU offload")):
        if flat.get(key):
            flat.unmap(flat.source_of(key), True, f"Megatron's {what} is not modelled")
    return notes


def _recompute(flat: Flat) -> list[str]:
    granularity, notes = flat.get("mg_recompute"), []
    if flat.get("mg_recompute_activations"):
        if granularity not in (None, "None", "selective"):
            notes.append(f"--recompute-activations overrides --recompute-granularity {granularity}: Megatron sets "
                         "recompute_granularity selective (arguments.py 607-608 @d98e8a6)")
        granularity = "selective"
    if granularity in (None, "None"):
        flat.put("recompute", "none", "--recompute-granularity")
        _full_only(flat, "no --recompute-granularity: nothing is recomputed")
        return []
    if granularity == "selective":
        flat.put("recompute", "selective", flat.source_of("mg_recompute"))
        if (method := flat.get("mg_recompute_method")) not in (None, "None"):
            flat.problems.append(f"--recompute-method {method} with --recompute-granularity selective: Megatron "
                                 "refuses a recompute method for selective recomputing (arguments.py)")
        return notes + _recompute_modules(flat)
    if granularity != "full":
        flat.problems.append(f"--recompute-granularity={granularity!r}: expected full or selective")
        return []
    method, layers = flat.get("mg_recompute_method"), flat.get("mg_recompute_layers")
    per_stage = flat.get("n_layers", 0) // max(flat.get("pp", 1), 1)
    layers_n = 1 if layers in (None, "None") else as_int(layers)
    if method == "uniform" and layers_n == 1 or method == "block" and layers_n >= per_stage:
        flat.put("recompute", "full", flat.source_of("mg_recompute"))
        return [f"--recompute-granularity full --recompute-method {method} --recompute-num-layers {layers_n}: every "
                "block recomputed (ShardLab's full recompute)"]
    if method in (None, "None"):
        flat.put("recompute", "full", flat.source_of("mg_recompute"))
        return ["--recompute-granularity full without --recompute-method (Megatron-core refuses it): every block "
                "recomputed (ShardLab's full recompute)"]
    if method not in ("uniform", "block"):
        flat.problems.append(f"--recompute-method={method!r}: expected uniform or block with --recompute-granularity "
                             "full")
        return []
    flat.put("recompute", f"{method}:{layers_n}", flat.source_of("mg_recompute_method"))
    return [f"--recompute-granularity full --recompute-method {method} --recompute-num-layers {layers_n}: recompute "
            f"{method}:{layers_n} (" + ("consecutive groups of" if method == "uniform" else "the first")
            + f" {layers_n} blocks of each pipeline stage module)"]


def _full_only(flat: Flat, why: str) -> None:
    """--recompute-method / --recompute-num-layers where Megatron does not read them: reported as ignored, with why."""
    for key in ("mg_recompute_method", "mg_recompute_layers"):
        if (value := flat.get(key)) not in (None, "None"):
            flat.ignore(flat.source_of(key), value, f"read under --recompute-granularity full only ({why})")


def _recompute_modules(flat: Flat) -> list[str]:
    """--recompute-modules (nargs '*': one word or a list) under selective recompute: the megatron stack's
    recompute_modules, checked by the spec (Megatron-Core's own refusals)."""
    modules = flat.get("mg_recompute_modules")
    if modules in (None, "None", True):
        return []
    names = [str(x) for x in (modules if isinstance(modules, list) else [modules])]
    unknown = [x for x in names if x not in {str(m) for m in RecomputeModule}]
    if unknown:
        flat.unmap(flat.source_of("mg_recompute_modules"), modules,
                   f"recompute modules {', '.join(unknown)} are not modelled (ShardLab prices "
                   f"{', '.join(str(m) for m in RecomputeModule)})")
        return []
    flat.put("recompute_modules", names, flat.source_of("mg_recompute_modules"))
    return [f"--recompute-modules {' '.join(names)}: selective recompute of those modules (Megatron-Core's "
            "recompute_modules), priced per module"]


def _stack(flat: Flat) -> list[str]:
    """stack megatron and the settings the arguments state (spec/stacks.py gives the rest its defaults, Megatron's)."""
    flat.put("stack", "megatron", "pretrain_gpt.py (Megatron-Core)")
    notes = []
    if flat.get("mg_transformer_impl", "transformer_engine") == "local":
        notes.append("--transformer-impl local: Megatron's own modules with its fused kernels (element-wise fused); "
                     "float8 GEMMs need Transformer Engine")
    notes += grad_dtypes(flat)
    if flat.get("mg_fp8_params"):
        flat.put("param_dtype", "fp8", "--fp8-param-gather")
    if flat.get("mg_no_p2p_overlap"):
        flat.put("pp_overlap", False, "--no-overlap-p2p-communication")
    if flat.get("mg_fp8_wgrad") is False:
        flat.unmap("--fp8-wgrad", False, "weight-gradient GEMMs in bf16 under fp8: predicted in fp8")
    if flat.get("tp_overlap") and flat.get("tp", 1) > 1 and not flat.get("sequence_parallel"):
        flat.problems.append("--tp-comm-overlap needs --sequence-parallel (Megatron asserts it: arguments.py "
                             "1441-1442)")
    return notes


MEGATRON_FP8_RECIPES = {"delayed": "tensorwise", "tensorwise": "tensorwise", "blockwise": "rowwise", "mxfp8": "rowwise"}
"""Transformer Engine's recipes (--fp8-recipe, default delayed) -> torchao's: one scale per tensor (delayed scaling
takes it from an amax history, tensorwise from the current amax), or finer-grained scales (blockwise 1x128 / 128x128,
MXFP8 32-element blocks) predicted as rowwise."""


def _fp8(flat: Flat, fmt: object) -> list[str]:
    """--fp8-format e4m3 | hybrid (and --fp8-recipe) -> precision fp8 with the closest fp8_recipe."""
    recipe = str(flat.get("mg_fp8_recipe") or "delayed")
    ours = MEGATRON_FP8_RECIPES.get(recipe)
    if ours is None:
        flat.problems.append(f"--fp8-recipe={recipe!r}: expected one of {', '.join(MEGATRON_FP8_RECIPES)}")
        return []
    flat.put("precision", "fp8", flat.source_of("fp8"))
    flat.put("fp8_recipe", ours,
             flat.source_of("mg_fp8_recipe") if flat.get("mg_fp8_recipe") else flat.source_of("fp8"))
    if recipe in ("blockwise", "mxfp8"):
        flat.unmap("--fp8-recipe", recipe, f"{recipe} scaling (per block of elements) is predicted as torchao's "
                   "rowwise recipe: the scales' bytes and the quantization kernels differ")
    return [f"fp8 format {fmt} ({recipe} scaling): precision fp8 with the {ours} recipe (float8 block linears, bf16 "
            "elsewhere); Transformer Engine's fp8 GEMMs are timed at the profile's fp8 peak like torchao's"]


def _pipeline(flat: Flat) -> list[str]:
    pp = flat.get("pp", 1)
    virtual = flat.get("mg_virtual")
    per_virtual = flat.get("mg_layers_per_virtual")
    if pp == 1:
        return []
    if virtual in (None, "None") and per_virtual not in (None, "None"):
        per_rank = flat.get("n_layers") // pp
        if per_rank % as_int(per_virtual):
            flat.problems.append(f"--num-layers-per-virtual-pipeline-stage {per_virtual} does not divide the "
                                 f"{per_rank} layers of each pipeline rank")
            return []
        virtual = per_rank // as_int(per_virtual)
    if virtual not in (None, "None") and as_int(virtual) > 1:
        flat.put("pp_schedule", "interleaved_1f1b", flat.source_of("mg_virtual"))
        flat.put("virtual_stages", as_int(virtual), flat.source_of("mg_virtual"))
    else:
        flat.put("pp_schedule", "1f1b", "--pipeline-model-parallel-size")
    return []
