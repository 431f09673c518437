"""Megatron-LM flags that override or refuse one another (NVIDIA/Megatron-LM @ d98e8a64ddf3): the import does what
Megatron does with the pair, and says so; nothing memory- or time-relevant vanishes from the output.

- arguments.py 1213-1214: --grad-reduce-in-bf16 sets accumulate_allreduce_grads_in_fp32 False (under --bf16);
- arguments.py 1209-1211: --accumulate-allreduce-grads-in-fp32 asserts --main-grads-dtype fp32;
- optimizer_config.py 468-474: --main-grads-dtype / --main-params-dtype other than fp32 need
  --use-precision-aware-optimizer (asserts);
- arguments.py 607-608: --recompute-activations sets recompute_granularity selective, whatever was given.
"""

from __future__ import annotations

import pytest

from backend.importers import ConfigImportError, import_config_text

BASE = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings "
        "1024 --micro-batch-size 1 --global-batch-size 8 --vocab-size 32000 --bf16 ")


def _import(flags: str):
    return import_config_text(BASE + flags, name="a.sh", gpus=4)


def test_grad_reduce_in_bf16_overrides_fp32_accumulation_with_a_note():
    imported = _import("--accumulate-allreduce-grads-in-fp32 --grad-reduce-in-bf16")
    assert imported.spec["train"]["grad_reduce_dtype"] == "bf16"
    note = [n for n in imported.notes if "--accumulate-allreduce-grads-in-fp32" in n]
    assert note and "--grad-reduce-in-bf16" in note[0] and "arguments.py 1213-1214" in note[0]


def test_fp32_accumulation_beside_bf16_main_grads_is_refused():
    with pytest.raises(ConfigImportError, match="can only be fp32 when --accumulate-allreduce-grads-in-fp32"):
        _import("--use-precision-aware-optimizer --main-grads-dtype bf16 --accumulate-allreduce-grads-in-fp32")


@pytest.mark.parametrize("flags", ["--main-grads-dtype bf16", "--main-params-dtype fp16"])
def test_main_dtypes_without_the_precision_aware_optimizer_are_refused(flags):
    with pytest.raises(ConfigImportError, match=f"{flags} without --use-precision-aware-optimizer: Megatron refuses"):
        _import(flags)


@pytest.mark.parametrize("flags, key, value", [
    ("--use-precision-aware-optimizer --main-grads-dtype bf16", "grad_reduce_dtype", "bf16"),
    ("--use-precision-aware-optimizer --main-params-dtype fp16", "master_dtype", "fp16"),
])
def test_main_dtypes_with_the_precision_aware_optimizer_are_mapped(flags, key, value):
    imported = _import(flags)
    assert imported.spec["train"][key] == value and not imported.unmapped


def test_recompute_activations_overriding_full_granularity_is_said():
    imported = _import("--recompute-activations --recompute-granularity full")
    assert imported.spec["train"]["recompute"] == "selective"
    note = [n for n in imported.notes if "--recompute-activations" in n]
    assert note and "--recompute-granularity full" in note[0] and "arguments.py 607-608" in note[0]


def test_grad_reduce_in_bf16_without_bf16_params_is_reported_as_unread():
    """Megatron reads --grad-reduce-in-bf16 under --bf16 only (arguments.py 1213): with --fp16 it has no effect."""
    imported = import_config_text(BASE.replace("--bf16", "--fp16") + "--grad-reduce-in-bf16 "
                                  "--accumulate-allreduce-grads-in-fp32", name="a.sh", gpus=4)
    assert imported.spec["train"]["grad_reduce_dtype"] == "fp32"
    assert "--bf16 only" in imported.ignored["--grad-reduce-in-bf16"]["reason"]
