"""Megatron-LM's gradient and main-parameter dtype flags -> grad_reduce_dtype / master_dtype, as Megatron resolves
them (NVIDIA/Megatron-LM @ d98e8a64ddf34856e74b24714e3bedb2f5a39553):

- megatron/training/arguments.py 1204-1217 validate_args, under --bf16 only: --accumulate-allreduce-grads-in-fp32
  asserts --main-grads-dtype fp32 (1209-1211); --grad-reduce-in-bf16 sets accumulate_allreduce_grads_in_fp32 False,
  whatever was given (1213-1214); otherwise fp32 main grads turn the fp32 accumulation on (1215-1217).
- megatron/core/optimizer/optimizer_config.py 468-474 OptimizerConfig.__post_init__: without
  --use-precision-aware-optimizer, main_grads_dtype and main_params_dtype must be fp32 (asserts).
"""

from __future__ import annotations

from backend.importers.fields import Flat

_PAIR = ("--grad-reduce-in-bf16 overrides --accumulate-allreduce-grads-in-fp32: Megatron sets "
         "accumulate_allreduce_grads_in_fp32 False under --bf16 (arguments.py 1213-1214 @d98e8a6), so gradients "
         "are reduced in bf16")


def grad_dtypes(flat: Flat) -> list[str]:
    """grad_reduce_dtype and master_dtype from the flags, or Megatron's refusal in flat.problems; returns notes."""
    if _refused(flat):
        return []
    notes = _reduce_dtype(flat)
    if flat.get("mg_main_params") not in (None, "fp32"):
        flat.put("master_dtype", flat.get("mg_main_params"), "--main-params-dtype")
    return notes


def _reduce_dtype(flat: Flat) -> list[str]:
    """grad_reduce_dtype: --grad-reduce-in-bf16 (read under --bf16 only) wins over the fp32 accumulation."""
    bf16_reduce = bool(flat.get("mg_grads_bf16") and flat.get("mg_bf16"))
    notes = [_PAIR] if bf16_reduce and flat.get("mg_grads_fp32") else []
    if flat.get("mg_grads_bf16") and not bf16_reduce:
        flat.ignore("--grad-reduce-in-bf16", True, "read under --bf16 only (arguments.py 1213 @d98e8a6): no effect "
                    "with fp16 or fp32 params")
    if bf16_reduce or flat.get("mg_main_grads") == "bf16":
        flat.put("grad_reduce_dtype", "bf16", "--grad-reduce-in-bf16" if bf16_reduce else "--main-grads-dtype")
    elif flat.get("mg_grads_fp32") or flat.get("mg_main_grads") == "fp32":
        flat.put("grad_reduce_dtype", "fp32", flat.source_of("mg_grads_fp32"))
    return notes


def _refused(flat: Flat) -> bool:
    """Megatron's own refusals of the flags (asserts), added to flat.problems; True where there is one."""
    before = len(flat.problems)
    if not flat.get("mg_precision_aware"):
        for key, flag in (("mg_main_grads", "--main-grads-dtype"), ("mg_main_params", "--main-params-dtype")):
            if flat.get(key) not in (None, "fp32"):
                flat.problems.append(
                    f"{flag} {flat.get(key)} without --use-precision-aware-optimizer: Megatron refuses it "
                    f"(core/optimizer/optimizer_config.py 468-474 @d98e8a6 asserts {key[3:]}_dtype fp32 when not "
                    "using the precision-aware optimizer); add the flag or drop the dtype")
    if flat.get("mg_bf16") and flat.get("mg_grads_fp32") and flat.get("mg_main_grads") not in (None, "fp32"):
        flat.problems.append("--accumulate-allreduce-grads-in-fp32 with --main-grads-dtype "
                             f"{flat.get('mg_main_grads')}: Megatron refuses the pair (arguments.py 1209-1211 "
                             "@d98e8a6: \"--main-grads-dtype can only be fp32 when "
                             "--accumulate-allreduce-grads-in-fp32 is set\")")
    return len(flat.problems) > before
