"""A Megatron-LM argument list where a flag that takes a value has none (another --flag follows it, or it is last):
the import said "--tensor-model-parallel-size=True: expected an integer", as if True had been given. It says the
value is missing now, for every flag that takes one; a store_true flag given bare still imports."""

from __future__ import annotations

import re

import pytest

from backend.importers import ConfigImportError, import_config_text

BASE = ("run.py --num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings "
        "1024 --micro-batch-size 1 --global-batch-size 8 --vocab-size 32000 ")


def _problems(extra: str) -> list[str]:
    with pytest.raises(ConfigImportError) as e:
        import_config_text(BASE + extra + "\n", name="bare.sh", fmt="megatron", gpus=8)
    return e.value.problems


@pytest.mark.parametrize("extra, flag, expected", [
    ("--tensor-model-parallel-size --swiglu", "--tensor-model-parallel-size", "expected an integer"),
    ("--tensor-model-parallel-size", "--tensor-model-parallel-size", "expected an integer"),
    ("--pipeline-model-parallel-size --sequence-parallel", "--pipeline-model-parallel-size", "expected an integer"),
    ("--normalization --swiglu", "--normalization", "expected one of layernorm, rmsnorm"),
    ("--kv-channels", "--kv-channels", "expected an integer"),
    ("--mtp-num-layers", "--mtp-num-layers", "expected an integer"),
    ("--recompute-granularity", "--recompute-granularity", "expected a value"),
    ("--moe-token-dispatcher-type", "--moe-token-dispatcher-type", "expected a value"),
    ("--fp8-format", "--fp8-format", "expected a value"),
    # a bare capacity factor was read as 1.0 (float(True)): a quiet wrong value, not even a message
    ("--moe-expert-capacity-factor --swiglu", "--moe-expert-capacity-factor", "expected a number"),
])
def test_a_flag_without_its_value_is_said_to_have_none(extra, flag, expected):
    problems = _problems(extra)
    assert any(p.startswith(f"{flag} has no value: {expected}") for p in problems), problems
    assert not any(re.search(rf"{flag}=True", p) for p in problems), problems


def test_a_value_that_is_given_is_still_named_as_given():
    problems = _problems("--tensor-model-parallel-size=True")
    assert any(p.startswith("--tensor-model-parallel-size='True': expected an integer") for p in problems), problems


def test_store_true_flags_given_bare_still_import():
    imported = import_config_text(BASE + "--swiglu --sequence-parallel --tensor-model-parallel-size 2\n",
                                  name="ok.sh", fmt="megatron", gpus=8)
    assert imported.spec["parallel"]["tp"] == 2 and imported.spec["model"]["mlp"] == "swiglu"
