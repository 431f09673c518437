"""Issue 34 item 3: importers map onto the stack. A Megatron-LM / NeMo config sets stack megatron and maps the kernel,
overlap, gradient-dtype, fp8 and recompute flags; a torchtitan TOML sets stack torchtitan with compile, float8, async
TP, loss parallel and its AC mode; a DeepSpeed JSON sets stack deepspeed. Nothing that changes memory or time is
filed under "ignored"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.analytic.steptime.hardware import get_hardware
from backend.importers.deepspeed_config import import_ds_config
from backend.importers.megatron_args import import_args
from backend.importers.torchtitan_toml import import_toml

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "imports"
ISSUE_SCRIPT = FIX / "megatron_llama31_8b_cp2.sh"
NO_EFFECT = ("training numerics", "numerics only", "profiling", "job bookkeeping", "optimizer / schedule", "unset",
             "the vocabulary comes with", "a consistency check", "already counts", "details of the",
             "kernel choice of the optimizer step", "autotuning")
"""The reasons an importer may file a key under "ignored": none of them changes memory or time."""
TIME_OR_MEMORY = ("--transformer-impl", "--attention-backend", "--overlap-grad-reduce", "--overlap-param-gather",
                  "--tp-comm-overlap", "--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16",
                  "--use-distributed-optimizer", "--fp8-format", "--fp8-recipe", "--fp8-param-gather",
                  "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--recompute-activations",
                  "--cross-entropy-loss-fusion", "--no-overlap-p2p-communication", "--ddp-bucket-size",
                  "--empty-unused-memory-level")


def _megatron(extra: str = "", base: Path = ISSUE_SCRIPT):
    return import_args(base.read_text().rstrip() + (" \\\n    " + extra if extra else "") + "\n")


def _no_time_or_memory_ignored(imported) -> None:
    for key, entry in imported.ignored.items():
        assert key not in TIME_OR_MEMORY, key
        assert any(w in entry["reason"] for w in NO_EFFECT), (key, entry["reason"])


def test_the_issues_megatron_script_imports_as_stack_megatron():
    imported = _megatron()
    t, p = imported.spec["train"], imported.spec["parallel"]
    assert t["stack"] == "megatron" and t["attention_kernel"] == "cudnn"  # --attention-backend fused: TE's cuDNN
    assert t["grad_reduce_overlap"] is True and t["param_gather_overlap"] is True
    assert (p["strategy"], p["cp"], p["tp"], p["world_size"]) == ("zero1", 2, 1, 8)
    assert "--transformer-impl" not in imported.ignored and not imported.unmapped
    _no_time_or_memory_ignored(imported)


@pytest.mark.parametrize("flags, expected", [
    ("--grad-reduce-in-bf16", {"grad_reduce_dtype": "bf16"}),
    ("--accumulate-allreduce-grads-in-fp32", {"grad_reduce_dtype": "fp32"}),
    ("--fp8-format hybrid --fp8-param-gather", {"precision": "fp8", "param_dtype": "fp8", "fp8_recipe": "tensorwise"}),
    ("--no-overlap-p2p-communication", {"pp_overlap": False}),
    ("--attention-backend flash", {"attention_kernel": "flash2"}),
    ("--context-parallel-size 1 --attention-backend unfused", {"attention_kernel": "eager"}),  # ring attention: fused
    ("--recompute-activations", {"recompute": "selective"}),
    ("--use-precision-aware-optimizer --main-params-dtype bf16", {"master_dtype": "bf16"}),
])
def test_megatron_flags_are_stack_settings(flags, expected):
    imported = _megatron(flags)
    for key, value in expected.items():
        assert imported.spec["train"][key] == value, (flags, key)
    _no_time_or_memory_ignored(imported)


def test_megatron_local_attention_and_tp_overlap():
    local = _megatron("--transformer-impl local")  # overrides the script's transformer_engine: the last flag wins
    assert local.spec["train"]["attention_kernel"] == "cudnn"  # the script's --attention-backend fused stays explicit
    text = ISSUE_SCRIPT.read_text().replace("--transformer-impl transformer_engine --attention-backend fused",
                                            "--transformer-impl local").replace("--context-parallel-size 2",
                                                                                "--context-parallel-size 1")
    plain = import_args(text)
    assert plain.spec["train"]["attention_kernel"] == "eager" and plain.spec["model"]["attention"] == "math"
    flash = import_args(text.replace("--transformer-impl local", "--transformer-impl local --use-flash-attn"))
    assert flash.spec["train"]["attention_kernel"] == "flash2" and flash.spec["model"]["attention"] == "flash"
    tp = import_args(text.replace("--tensor-model-parallel-size 1",
                                  "--tensor-model-parallel-size 2 --sequence-parallel "
                                  "--tp-comm-overlap --tp-comm-bulk-wgrad"))
    assert tp.spec["train"]["tp_overlap"] is True and "--tp-comm-bulk-wgrad" in tp.unmapped


def test_megatron_kernel_and_buffer_options_are_reported_not_ignored():
    imported = _megatron("--cross-entropy-loss-fusion --ddp-bucket-size 100000000 --empty-unused-memory-level 1 "
                         "--no-rope-fusion")
    for key in ("--cross-entropy-loss-fusion", "--ddp-bucket-size", "--empty-unused-memory-level", "--no-rope-fusion"):
        assert key in imported.unmapped, key
    _no_time_or_memory_ignored(imported)


def test_megatron_example_scripts_file_nothing_time_relevant_as_ignored():
    for script in sorted((FIX / "megatron_examples").rglob("train_llama*.sh")) + [FIX / "megatron_llama2_70b.sh"]:
        try:
            imported = import_args(script.read_text())
        except Exception:  # noqa: BLE001 - scripts that need a vocabulary or GPUs on import are covered elsewhere
            continue
        assert imported.spec["train"]["stack"] == "megatron", script
        _no_time_or_memory_ignored(imported)


TOML = """
[job]
description = "llama3 70b"
[model]
name = "llama3"
flavor = "70B"
converters = ["float8"]
[training]
local_batch_size = 16
seq_len = 8192
mixed_precision_param = "bfloat16"
mixed_precision_reduce = "float32"
[parallelism]
data_parallel_shard_degree = 32
tensor_parallel_degree = 8
enable_async_tensor_parallel = true
[compile]
enable = true
components = ["model"]
[activation_checkpoint]
mode = "full"
[quantize.linear.float8]
enable_fsdp_float8_all_gather = true
precompute_float8_dynamic_scale_for_fsdp = true
"""


def test_torchtitan_toml_is_stack_torchtitan():
    imported = import_toml(TOML, gpus=256)
    t, p = imported.spec["train"], imported.spec["parallel"]
    assert t["stack"] == "torchtitan" and t["elementwise"] == "compiled" and t["tp_overlap"] is True
    assert t["loss_parallel"] is True and t["precision"] == "fp8" and t["fp8_all_gather"] is True
    assert t["recompute"] == "full" and t["grad_reduce_dtype"] == "fp32"
    assert (p["tp"], p["dp"], p["sequence_parallel"], p["strategy"]) == (8, 32, True, "zero3")
    assert not any(k.startswith(("compile", "parallelism.enable_async")) for k in imported.unmapped), imported.unmapped
    no_lp = import_toml(TOML.replace("enable_async_tensor_parallel = true", "disable_loss_parallel = true"), gpus=256)
    assert no_lp.spec["train"]["loss_parallel"] is False and no_lp.spec["train"]["tp_overlap"] is None
    assert t["loss_compiled"] is False  # components = ["model"]: the loss stays eager
    with_loss = import_toml(TOML.replace('components = ["model"]', 'components = ["model", "loss"]'), gpus=256)
    assert with_loss.spec["train"]["loss_compiled"] is True and "compile.components" not in with_loss.unmapped
    old_key = import_toml(TOML.replace('components = ["model"]\n', ""), gpus=256)  # no components: the stack's default
    assert old_key.spec["train"].get("loss_compiled") is None
    legacy = import_toml(TOML.replace('[compile]\nenable = true\ncomponents = ["model"]\n', "").replace(
        "[training]\n", "[training]\ncompile = true\n"), gpus=256)  # the key before the [compile] section
    assert legacy.spec["train"]["elementwise"] == "compiled" and legacy.spec["train"].get("loss_compiled") is None
    assert any("training.compile: predicted with the loss compiled too" in n for n in legacy.notes), legacy.notes


def test_torchtitan_loss_only_compile_leaves_the_blocks_eager():
    """compile.components = ["loss"]: torchtitan compiles the loss, not the blocks (parallelize.py
    model_compile_enabled needs "model"), so the import must not predict fused element-wise blocks, and async TP
    (which needs the compiled blocks) is flagged."""
    imported = import_toml(TOML.replace('components = ["model"]', 'components = ["loss"]'), gpus=256)
    t = imported.spec["train"]
    assert t.get("elementwise") is None and t["loss_compiled"] is True
    assert any('without "model"' in n for n in imported.notes), imported.notes
    assert "parallelism.enable_async_tensor_parallel" in imported.unmapped, imported.unmapped


def test_deepspeed_json_is_stack_deepspeed():
    cfg = json.loads((FIX / "llama2_7b_config.json").read_text())
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
          "zero_optimization": {"stage": 1, "overlap_comm": True, "reduce_bucket_size": 200000000},
          "data_types": {"grad_accum_dtype": "fp32"}}
    imported = import_ds_config(json.dumps(ds), gpus=8, model_config=cfg)
    t = imported.spec["train"]
    assert t["stack"] == "deepspeed" and t["grad_reduce_dtype"] == "fp32" and t["grad_reduce_overlap"] is True
    assert "zero_optimization.reduce_bucket_size" in imported.unmapped
    assert "data_types.grad_accum_dtype" not in imported.ignored


@pytest.mark.parametrize("extra, fits", [("--grad-reduce-in-bf16", True), ("", False)])
def test_the_issues_megatron_recipe_fits_80gb_as_nvidia_runs_it(tmp_path, capsys, extra, fits):
    """The script transcribes Megatron-Bridge's llama3_8b_pretrain_8gpu_h100_bf16_config, whose _perf_precision("bf16")
    and _benchmark_common both set grad_reduce_in_fp32 = False (Megatron-Bridge 007282e perf_recipes/_common.py):
    Megatron-LM's --grad-reduce-in-bf16. Run that way, `estimate --hardware h100-sxm` says it fits an 80 GB H100
    (2 B param + 2 B grad buffer + 12 / (dp x cp) B optimizer per parameter, TE's saved tensors at s = 8,192 / cp 2).
    As the fixture writes it, without the flag, Megatron-LM keeps fp32 main grads for --bf16 (arguments.py 1204-1217:
    accumulate_allreduce_grads_in_fp32), a 4 B x 8.03 B = 32 GB grad buffer, and the same estimate says it does not."""
    from backend.cli import main

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(_megatron(extra).spec))
    assert main(["estimate", "--spec", str(spec), "--hardware", "h100-sxm", "--json", "--rank-limit", "1"]) == 0
    fit = json.loads(capsys.readouterr().out)["fit"]
    assert fit["fits"] is fits and fit["device_bytes"] == get_hardware("h100-sxm").memory_bytes, fit
    assert 79 * 2**30 < fit["device_bytes"] < 80 * 2**30  # what CUDA reports on an 80 GB H100, not 80e9 bytes
