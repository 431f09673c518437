"""DeepSpeed config import picks the spec's framework before validating it: a layout only DeepSpeed has (ZeRO's
offload_optimizer alone: torch FSDP2's CPUOffloadPolicy moves parameters too) is a deepspeed spec, a layout
ShardLab's DeepSpeed engine does not run (AutoTP) a torch one with the reason, and a layout neither takes is refused
with each framework's reasons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from backend.cli import main
from backend.importers import ConfigImportError
from backend.importers.deepspeed_config import import_ds_config

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "imports"
LLAMA2_7B = json.loads((FIX / "llama2_7b_config.json").read_text())
OFFLOAD_OPTIMIZER = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
                     "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 2e-5}},
                     "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                           "offload_param": {"device": "none"}}}


def _with(**extra) -> str:
    return json.dumps({**OFFLOAD_OPTIMIZER, **extra})


def test_offload_optimizer_alone_is_a_deepspeed_spec(tmp_path, capsys):
    ds, cfg = tmp_path / "ds.json", tmp_path / "config.json"
    ds.write_text(_with())
    cfg.write_text(json.dumps(LLAMA2_7B))
    assert main(["import-config", str(ds), "--model-config", str(cfg), "--gpus", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    par = out["spec"]["parallel"]
    assert out["spec"]["framework"] == "deepspeed" and (par["strategy"], par["offload"], par["dp"]) == (
        "zero3", "optimizer", 16)
    assert not any("predicted as a torch spec" in n for n in out["notes"])
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(out))
    assert main(["estimate", "--spec", str(spec), "--json", "--rank-limit", "1"]) == 0


def test_a_layout_the_deepspeed_engine_does_not_run_is_a_torch_spec_with_the_reason():
    no_offload = json.loads(_with(tensor_parallel={"autotp_size": 2}))
    no_offload["zero_optimization"]["offload_optimizer"]["device"] = "none"
    imported = import_ds_config(json.dumps(no_offload), gpus=16, model_config=LLAMA2_7B)
    assert imported.spec["framework"] == "torch" and imported.spec["parallel"]["tp"] == 2
    assert any("predicted as a torch spec of the same layout: ShardLab's deepspeed engine does not run it" in n
               and "tp=2 must be 1" in n for n in imported.notes), imported.notes


def test_a_layout_neither_framework_takes_names_each_ones_reasons():
    with pytest.raises(ConfigImportError) as err:
        import_ds_config(_with(tensor_parallel={"autotp_size": 2}), gpus=16, model_config=LLAMA2_7B)
    text = "\n".join(err.value.problems)
    assert "as framework deepspeed: framework deepspeed runs ZeRO data parallelism only" in text
    assert "as framework torch: torch FSDP2's CPUOffloadPolicy" in text


def test_import_run_takes_the_offload_optimizer_config(tmp_path, monkeypatch):
    from backend.importers.runs import import_run
    from db import queries as q
    from db.session import open_db

    url = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("SHARDLAB_DB_URL", url)
    fixture = json.loads((FIX / "deepspeed_zero3.json").read_text())
    fixture["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(fixture))
    engine = open_db(url)
    run_id = import_run(engine, config=config, log=FIX / "deepspeed_zero3.log", hardware="h100-sxm",
                        model_config=FIX / "llama2_7b_config.json")
    spec = q.get_experiment(engine, run_id)["spec"]
    assert (spec.framework, spec.parallel.offload) == ("deepspeed", "optimizer")


def test_an_auto_precision_is_reported_as_unmapped_not_silently_fp32(tmp_path, capsys):
    """A Hugging Face Trainer ds_config ("bf16": {"enabled": "auto"}) leaves the precision to the Trainer's flags: the
    import predicts fp32 (twice bf16's parameter bytes) and must say so, not pass it off as what the config says."""
    ds, cfg = tmp_path / "ds.json", tmp_path / "config.json"
    ds.write_text(_with(bf16={"enabled": "auto"}, fp16={"enabled": "auto"}))
    cfg.write_text(json.dumps(LLAMA2_7B))
    assert main(["import-config", str(ds), "--model-config", str(cfg), "--gpus", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spec"]["train"]["precision"] == "fp32"
    for key in ("bf16.enabled", "fp16.enabled"):
        assert out["unmapped"][key]["value"] == "auto" and "predicted as fp32" in out["unmapped"][key]["reason"]
    ds.write_text(_with())  # "enabled": true stays a mapped bf16-mixed, nothing unmapped about it
    assert main(["import-config", str(ds), "--model-config", str(cfg), "--gpus", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["spec"]["train"]["precision"] == "bf16-mixed" and "bf16.enabled" not in out["unmapped"]


def test_bf16_beside_fp16_is_refused_as_deepspeed_refuses_it():
    """Both enabled imported silently as bf16-mixed; DeepSpeedConfig asserts 'bfloat16 and fp16 modes cannot be
    simultaneously enabled'."""
    with pytest.raises(ConfigImportError, match="bf16.enabled and fp16.enabled both true"):
        import_ds_config(_with(fp16={"enabled": True}), gpus=16, model_config=LLAMA2_7B)


def test_gradient_accumulation_left_out_is_derived_from_the_gpus_as_deepspeed_does():
    """train_batch_size 16, micro 1 and no gradient_accumulation_steps on 8 GPUs: DeepSpeed derives 16 / (1 x 8) = 2
    accumulation steps; the import assumed 1, took dp = 16 and refused the 8 GPUs (dp(16) ... != GPUs(8))."""
    cfg = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 2}}
    spec = import_ds_config(json.dumps(cfg), gpus=8, model_config=LLAMA2_7B).spec
    assert (spec["parallel"]["dp"], spec["train"]["global_batch"], spec["train"]["microbatches"]) == (8, 16, 2)
    spec = import_ds_config(json.dumps(cfg), model_config=LLAMA2_7B).spec  # no GPU count: accumulation 1, as before
    assert (spec["parallel"]["dp"], spec["train"]["global_batch"]) == (16, 16)
