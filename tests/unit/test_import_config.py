"""Issue 25 config import: torchtitan (job TOML, Trainer.Config dump), Megatron-LM (arguments, log block), NeMo YAML,
DeepSpeed (ds_config + config.json) -> spec; round trips through `estimate`; every unmapped field reported; bad input.

Expected parameter counts are the published ones (backend/presets.py: Meta-Llama-3-8B 8,030,261,248 and
Llama-2-7b 6,738,415,616 from the Hugging Face Hub safetensors totals) or that count plus Megatron's vocabulary
padding computed here by hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from backend.cli import main
from backend.importers import ConfigImportError, import_config, import_config_text
from backend.importers.fields import SPEC_FIELDS, Pending
from backend.presets import PRESETS

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "imports"


def _import_json(capsys, *args: str) -> dict:
    assert main(["import-config", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _estimate(capsys, tmp_path: Path, imported: dict) -> dict:
    path = tmp_path / "imported.json"
    path.write_text(json.dumps(imported))
    assert main(["estimate", "--spec", str(path), "--json", "--rank-limit", "4"]) == 0
    return json.loads(capsys.readouterr().out)


def test_torchtitan_llama3_8b_toml_round_trip(capsys, tmp_path):
    out = _import_json(capsys, str(FIX / "torchtitan_llama3_8b.toml"), "--gpus", "64")
    assert set(out) >= {"spec", "ignored", "unmapped"}
    par = out["spec"]["parallel"]
    assert (par["world_size"], par["dp"], par["tp"], par["pp"], par["strategy"]) == (64, 64, 1, 1, "zero3")
    assert out["spec"]["train"]["recompute"] == "full" and out["spec"]["train"]["precision"] == "bf16-mixed"
    assert out["spec"]["model"]["seq_len"] == 8192 and out["spec"]["train"]["global_batch"] == 64
    est = _estimate(capsys, tmp_path, out)
    assert est["params_total"] == PRESETS["llama-3-8b"].published_params == 8_030_261_248
    assert est["per_rank_page"]["world_size"] == 64 if "per_rank_page" in est else len(est["per_rank"]) == 4
    assert out["ignored"]["optimizer.lr"]["value"] == 3e-4  # reported with its value, never dropped


def test_megatron_70b_tp_pp_cp_round_trip(capsys, tmp_path):
    out = _import_json(capsys, str(FIX / "megatron_llama2_70b.sh"))  # GPUs from torchrun --nproc_per_node 8 --nnodes 16
    par = out["spec"]["parallel"]
    assert (par["tp"], par["pp"], par["dp"], par["sequence_parallel"]) == (8, 4, 2, True)
    assert out["gpus"] == 128 and par["world_size"] == 128 and par["cp"] == 2  # --context-parallel-size is parallel.cp
    assert par["cp_rotate"] == "alltoall" and par["cp_load_balance"] is True  # Megatron's default p2p ring, zigzag
    assert "--context-parallel-size" not in out["unmapped"] and out["spec"]["model"]["attention"] == "flash"
    assert out["spec"]["train"]["recompute"] == "selective" and out["spec"]["parallel"]["strategy"] == "zero1"
    est = _estimate(capsys, tmp_path, out)
    padding = (32768 - 32000) * 8192 * 2  # vocabulary padded to 128 x tp 8 = 1024: embedding and untied output rows
    assert est["params_total"] == PRESETS["llama-2-70b"].published_params + padding == 68_989_231_104
    # issue 34: the import is stack megatron (TE's fused kernels, vocab-parallel loss): prediction only here, with the
    # reason; the same layout on this engine's stack runs (zero1 x tp / pp = Megatron's distributed optimizer, issue 26)
    assert out["spec"]["train"]["stack"] == "megatron"
    assert est["runnable"] is False and "stack megatron: set stack shardlab to run this layout" in est["why_not"]
    from backend.spec import ExperimentSpec
    from backend.spec.checks import run_blockers
    from backend.spec.stacks import SETTINGS

    train = {**out["spec"]["train"], "stack": "shardlab", **{k: None for k in SETTINGS}}
    assert run_blockers(ExperimentSpec.for_prediction({**out["spec"], "train": train})) == []


def test_deepspeed_zero3_round_trip(capsys, tmp_path):
    out = _import_json(capsys, str(FIX / "deepspeed_zero3.json"), "--model-config", str(FIX / "llama2_7b_config.json"))
    par = out["spec"]["parallel"]
    assert (par["strategy"], par["dp"], par["world_size"]) == ("zero3", 16, 16)
    assert out["spec"]["framework"] == "deepspeed" and out["spec"]["train"]["microbatches"] == 4
    est = _estimate(capsys, tmp_path, out)
    assert est["params_total"] == PRESETS["llama-2-7b"].published_params == 6_738_415_616


def test_torchtitan_trainer_config_dump(capsys):
    out = _import_json(capsys, str(FIX / "torchtitan_trainer_config.json"), "--gpus", "16")
    par = out["spec"]["parallel"]
    assert (par["dp"], par["tp"], par["sequence_parallel"], par["strategy"]) == (8, 2, True, "zero3")
    assert out["spec"]["train"]["recompute"] == "full"  # the FullAC policy object (no SAC-only fields)
    from backend.analytic.params import count_params
    from backend.spec import ExperimentSpec

    assert count_params(ExperimentSpec.for_prediction(out["spec"]).model) == 8_030_261_248
    # issue 34: torchtitan's loss parallel (on whenever tp > 1) is the spec's loss_parallel, no longer unmapped
    assert out["spec"]["train"]["loss_parallel"] is True and out["spec"]["train"]["stack"] == "torchtitan"
    assert "parallelism.disable_loss_parallel" not in out["unmapped"]


def test_torchtitan_dump_inside_a_log():
    cfg = json.loads((FIX / "torchtitan_trainer_config.json").read_text())
    text = json.dumps(cfg, indent=2)
    log = ("[titan] 2026-03-01 10:00:00,000 - root - INFO - Starting job: llama3 8B\n"
           "[titan] 2026-03-01 10:00:01,000 - root - INFO - Running with configs: " + text + "\n"
           "[titan] 2026-03-01 10:00:02,000 - root - INFO - Building llama3 8B\n")
    imported = import_config_text(log, name="train.log", gpus=16)
    assert imported.source_format == "torchtitan-config-dump" and imported.spec["parallel"]["tp"] == 2
    with pytest.raises(ConfigImportError, match="not complete JSON"):
        import_config_text(log[: len(log) // 2], name="train.log", gpus=16)


def test_nemo_yaml(capsys):
    out = _import_json(capsys, str(FIX / "nemo_gpt_tp2.yaml"))
    par = out["spec"]["parallel"]
    assert (out["gpus"], par["dp"], par["tp"], par["pp"], par["strategy"]) == (16, 4, 2, 2, "zero1")
    m = out["spec"]["model"]
    assert (m["vocab_size"], m["seq_len"], m["norm"], m["positions"], m["tie_embeddings"]) == (50432, 2048, "layernorm",
                                                                                               "learned", True)
    h, layers = 2048, 24  # GPT block 12h^2 + 13h, tied padded vocabulary, learned positions, final LayerNorm
    from backend.analytic.params import count_params
    from backend.spec import ExperimentSpec

    expected = layers * (12 * h * h + 13 * h) + 50432 * h + 2048 * h + 2 * h
    assert count_params(ExperimentSpec.for_prediction(out["spec"]).model) == expected


def test_megatron_arguments_block_of_a_log():
    lines = ["------------------------ arguments ------------------------"]
    args = {"num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "seq_length": 4096,
            "max_position_embeddings": 4096, "micro_batch_size": 1, "global_batch_size": 64, "padded_vocab_size": 32000,
            "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
            "world_size": 16, "data_parallel_size": 8, "swiglu": True, "ffn_hidden_size": 11008,
            "normalization": "RMSNorm", "position_embedding_type": "rope", "untie_embeddings_and_output_weights": True,
            "add_bias_linear": False, "bf16": True, "fp16": False, "use_distributed_optimizer": False,
            "recompute_granularity": None, "num_experts": None, "some_future_argument": 3,
            "unset_future_argument": None}
    for k in sorted(args):
        lines.append(f"  {k} {'.' * (48 - len(k))} {args[k]}")
    lines.append("-------------------- end of arguments ---------------------")
    imported = import_config_text("\n".join(lines), name="megatron.log")
    assert imported.source_format == "megatron-log-args" and imported.gpus == 16
    assert imported.spec["parallel"]["dp"] == 8 and imported.spec["model"]["bias"] == "none"
    assert imported.spec["model"]["n_kv_heads"] is None and imported.spec["parallel"]["strategy"] == "ddp"
    assert imported.unmapped["--some-future-argument"]["value"] == 3  # unknown and set: reported
    assert "--unset-future-argument" in imported.ignored  # unknown and unset: not worth a line


def test_contradictory_degrees_show_the_arithmetic(tmp_path):
    toml = (FIX / "torchtitan_llama3_8b.toml").read_text().replace("data_parallel_shard_degree = -1",
                                                                   "data_parallel_shard_degree = 2")
    toml = toml.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 4")
    with pytest.raises(ConfigImportError) as e:
        import_config_text(toml, name="x.toml", gpus=16)
    assert "dp_replicate(1) * dp_shard(2) * cp(1) * tp(4) * pp(1) = 8 != GPUs(16)" in str(e.value)
    with pytest.raises(ConfigImportError, match=r"multiply to 64, which does not divide 96 \(96 % 64 = 32\)"):
        import_config_text((FIX / "megatron_llama2_70b.sh").read_text().rsplit("pretrain_gpt.py", 1)[1],
                           name="a.sh", gpus=96)
    with pytest.raises(ConfigImportError, match="contradicts the config's 128 GPUs"):
        import_config(FIX / "megatron_llama2_70b.sh", gpus=64)
    with pytest.raises(ConfigImportError, match="pass --gpus N"):
        import_config(FIX / "torchtitan_llama3_8b.toml")


def test_model_the_spec_cannot_express_and_missing_model():
    with pytest.raises(ConfigImportError, match="tp=8 does not divide n_heads=12"):
        import_config_text("--num-layers 2 --hidden-size 768 --num-attention-heads 12 --seq-length 128 "
                           "--vocab-size 1000 --micro-batch-size 1 --tensor-model-parallel-size 8", name="a.sh", gpus=8)
    with pytest.raises(ConfigImportError, match="describes no model"):
        import_config(FIX / "deepspeed_zero3.json")
    with pytest.raises(ConfigImportError, match="vocabulary size is unknown"):
        import_config_text("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
                           "--micro-batch-size 1", name="a.sh", gpus=1)
    with pytest.raises(ConfigImportError, match="shell variables"):
        import_config_text("--num-layers $LAYERS --hidden-size 64", name="a.sh", gpus=1)


def test_unknown_keys_are_reported_with_value_and_custom_code_is_never_imported():
    toml = (FIX / "torchtitan_llama3_8b.toml").read_text() + (
        '\n[experimental]\ncustom_import = "shardlab_never_imported_module"\n\n[brand_new_section]\nknob = 7\n')
    imported = import_config_text(toml, name="x.toml", gpus=8)
    assert imported.unmapped["brand_new_section.knob"]["value"] == 7
    assert "not known to this importer" in imported.unmapped["brand_new_section.knob"]["reason"]
    assert "never imports" in imported.unmapped["experimental.custom_import"]["reason"]
    assert "shardlab_never_imported_module" not in sys.modules


def test_hostile_strings_are_data(capsys):
    toml = (FIX / "torchtitan_llama3_8b.toml").read_text().replace(
        'description = "Llama 3 8B training"', 'description = "x\\u001b[2J\\u202e$(rm -rf /)\\nfake row"')
    toml += '\n[evil]\n"k\\u001b[31m" = "$(touch /tmp/pwned)"\n'
    imported = import_config_text(toml, name="x.toml", gpus=8)
    assert "\x1b" not in imported.spec["name"] and "\\x1b" in imported.spec["name"]
    assert imported.unmapped["evil.k\x1b[31m"]["value"] == "$(touch /tmp/pwned)"  # kept verbatim as data
    from backend.cli.import_config import summary_text

    text = summary_text(imported)
    assert "\x1b" not in text and "\\x1b[31m" in text
    assert not Path("/tmp/pwned").exists()


def test_pending_features_are_one_line_each():
    """Every issue-26 feature is wired now: no Pending entry is left; cp (with its K/V rotation), fp8 and the AC
    policies map to spec fields."""
    pending = {k: v.target for k, v in SPEC_FIELDS.items() if isinstance(v, Pending)}
    assert pending == {}
    assert SPEC_FIELDS["cp"] == "parallel.cp" and SPEC_FIELDS["cp_rotate"] == "parallel.cp_rotate"
    toml = (FIX / "torchtitan_llama3_8b.toml").read_text().replace('# converters', 'converters').replace(
        'name = "llama3"', 'name = "llama3"\nconverters = ["float8"]')
    imported = import_config_text(toml, name="x.toml", gpus=8)
    assert "model.converters" not in imported.unmapped
    assert imported.spec["train"]["precision"] == "fp8"


def _megatron(**swap: str):
    """The 70B Megatron fixture with flags replaced (old text -> new text)."""
    text = (FIX / "megatron_llama2_70b.sh").read_text()
    for old, new in swap.items():
        assert old in text, old
        text = text.replace(old, new)
    return import_config_text(text, name="pretrain.sh")


def test_megatron_distributed_optimizer_is_the_distributed_optimizer():
    """--use-distributed-optimizer with tp 8 x pp 4 -> zero1, which the engine runs as Megatron's distributed optimizer
    (a layout it refused before issue 26); without the flag: ddp."""
    from backend.analytic.layout import Layout
    from backend.spec import ExperimentSpec
    from backend.spec.checks import run_blockers
    from backend.spec.stacks import SETTINGS

    spec = ExperimentSpec.for_prediction(_megatron().spec)
    assert spec.parallel.strategy == "zero1" and Layout.of(spec).distributed_optimizer
    # issue 34: stack megatron is prediction only here; the layout on this engine's own stack runs
    assert run_blockers(spec) and all("stack megatron" in b for b in run_blockers(spec))
    engine = spec.model_copy(update={"train": spec.train.model_copy(update={"stack": "shardlab",
                                                                             **{k: None for k in SETTINGS}})})
    assert run_blockers(engine) == []
    assert any("which ShardLab runs and predicts as Megatron's distributed optimizer" in n for n in _megatron().notes)
    assert _megatron(**{"--use-distributed-optimizer ": ""}).spec["parallel"]["strategy"] == "ddp"


@pytest.mark.parametrize("method, layers, expected", [("uniform", 2, "uniform:2"), ("block", 3, "block:3"),
                                                      ("uniform", 1, "full"), ("block", 20, "full")])
def test_megatron_recompute_method_is_the_spec_policy(method, layers, expected):
    """--recompute-granularity full --recompute-method M --recompute-num-layers N -> recompute M:N (20 layers per
    pipeline stage here: block:20 and uniform:1 recompute every block, i.e. full)."""
    imported = _megatron(**{"--recompute-granularity selective": f"--recompute-granularity full --recompute-method "
                                                                   f"{method} --recompute-num-layers {layers}"})
    assert imported.spec["train"]["recompute"] == expected
    assert not any("recompute" in key for key in imported.unmapped)


@pytest.mark.parametrize("flags, recipe, unmapped", [("--fp8-format hybrid", "tensorwise", False),
                                                     ("--fp8-format e4m3 --fp8-recipe tensorwise", "tensorwise", False),
                                                     ("--fp8-format hybrid --fp8-recipe mxfp8", "rowwise", True)])
def test_megatron_fp8_is_precision_fp8(flags, recipe, unmapped):
    """--fp8-format (Transformer Engine, delayed scaling by default) -> precision fp8 with the closest torchao recipe;
    block scaling (mxfp8 / blockwise) is reported as predicted rowwise."""
    imported = _megatron(**{"--bf16": f"--bf16 {flags}"})
    train = imported.spec["train"]
    assert (train["precision"], train["fp8_recipe"]) == ("fp8", recipe)
    assert ("--fp8-recipe" in imported.unmapped) == unmapped
    assert not any(v.get("pending") == "train.precision" for v in imported.unmapped.values())


def test_megatron_fp8_unknown_recipe_is_refused():
    with pytest.raises(ConfigImportError, match="--fp8-recipe='nvfp4'"):
        _megatron(**{"--bf16": "--bf16 --fp8-format hybrid --fp8-recipe nvfp4"})


def _torchtitan(ac: str, float8: str = "") -> dict:
    text = (FIX / "torchtitan_llama3_8b.toml").read_text()
    text = text.replace('mode = "full"\nselective_ac_option = "op"', ac)
    if float8:
        text = text.replace('name = "llama3"', 'name = "llama3"\nconverters = ["float8"]').replace(
            "enable_fsdp_float8_all_gather = false", float8)
    return import_config_text(text, name="job.toml", gpus=8).spec


@pytest.mark.parametrize("ac, expected", [('mode = "selective"\nselective_ac_option = "op"', "op"),
                                          ('mode = "selective"\nselective_ac_option = "2"', "layers:2"),
                                          ('mode = "full"\nselective_ac_option = "op"', "full"),
                                          ('mode = "none"', "none")])
def test_torchtitan_activation_checkpoint_is_the_spec_policy(ac, expected):
    """[activation_checkpoint] mode / selective_ac_option -> recompute (op-level SAC, every K-th block, full, none)."""
    assert _torchtitan(ac)["train"]["recompute"] == expected


def test_torchtitan_float8_is_precision_fp8():
    """model.converters = ["float8"] with [float8] recipe_name / enable_fsdp_float8_all_gather -> precision fp8, its
    recipe and FSDP2's float8 all-gather (torchtitan's default: off); op SAC alongside, as torchtitan's llama3 runs."""
    ac = 'mode = "selective"\nselective_ac_option = "op"'
    train = _torchtitan(ac, "enable_fsdp_float8_all_gather = true")["train"]
    assert (train["precision"], train["fp8_recipe"], train["fp8_all_gather"], train["recompute"]) == \
        ("fp8", "tensorwise", True, "op")
    train = _torchtitan(ac, 'enable_fsdp_float8_all_gather = false\nrecipe_name = "rowwise"')["train"]
    assert (train["precision"], train["fp8_recipe"], train["fp8_all_gather"]) == ("fp8", "rowwise", False)


def test_spec_file_from_import_is_accepted_by_submit_validation(capsys, tmp_path):
    """estimate/trace/submit read `--spec`: the import-config JSON is accepted as is (its spec), with a note."""
    out = _import_json(capsys, str(FIX / "deepspeed_zero3.json"), "--model-config", str(FIX / "llama2_7b_config.json"))
    out["unmapped"] = {"x": {"value": 1, "reason": "test"}}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(out))
    from backend.cli.spec_flags import load_spec_file

    assert load_spec_file(path)["parallel"]["strategy"] == "zero3"
    assert "not in the spec: x" in capsys.readouterr().err


def test_torchtitan_config_as_wandb_stored_it(tmp_path):
    """W&B's config.yaml ({key: {desc, value}} + _wandb) of a torchtitan run: the Trainer.Config it was sent."""
    import yaml

    cfg = json.loads((FIX / "torchtitan_trainer_config.json").read_text())
    wandb = {"_wandb": {"desc": None, "value": {"cli_version": "0.19.0", "python_version": "3.12.3"}},
             **{k: {"desc": None, "value": v} for k, v in cfg.items()}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(wandb))
    imported = import_config(path, gpus=16)
    assert imported.source_format == "torchtitan-config-dump" and imported.spec["parallel"]["tp"] == 2


@pytest.mark.parametrize("key", sorted({k for k in __import__("backend.importers.torchtitan_models",
                                                                   fromlist=["PRESETS"]).PRESETS}))
def test_torchtitan_flavors_are_the_presets_they_name(key):
    """torchtitan's own flavor args (FeedForward rule) give exactly the shape of the preset the import names."""
    from backend.importers.torchtitan_models import PRESETS as FLAVOR_PRESETS
    from backend.importers.torchtitan_models import flavor_model

    model, _ = flavor_model(*key, seq_len=4096)
    preset = PRESETS[FLAVOR_PRESETS[key]].model
    assert model["source"]["preset"] == FLAVOR_PRESETS[key]
    for field in ("vocab_size", "d_model", "n_layers", "n_heads", "ffn_hidden", "norm", "mlp", "positions", "bias",
                  "tie_embeddings"):
        assert model[field] == preset[field], field
    assert (model["n_kv_heads"] or model["n_heads"]) == (preset.get("n_kv_heads") or preset["n_heads"])


def test_yaml_alias_bomb_is_refused_quickly():
    """A 1 KB YAML whose anchors expand to 2^30 values ("billion laughs") is refused, not walked."""
    import time

    lines = ["a0: &a0 {x: 1, y: 1}"] + [f"a{i}: &a{i} {{x: *a{i - 1}, y: *a{i - 1}}}" for i in range(1, 31)]
    text = "\n".join(lines) + "\nmodel: {num_layers: *a30}\n"
    start = time.perf_counter()
    with pytest.raises(ConfigImportError, match="expands to more than"):
        import_config_text(text, name="bomb.yaml")
    with pytest.raises(ConfigImportError, match="expands to more than"):
        import_config_text(text + "_wandb: {value: 1}\n", name="config.yaml")
    assert time.perf_counter() - start < 10


def test_deeply_nested_dump_in_a_log_is_refused():
    log = "x - INFO - Running with configs: " + "[" * 100_000 + "]" * 100_000 + "\n"
    with pytest.raises(ConfigImportError, match="nests too deep|levels deep"):
        import_config_text(log, name="train.log", fmt="torchtitan")


def test_torchtitan_context_parallel_degree_is_parallel_cp():
    """torchtitan's parallelism.context_parallel_degree (and its rotate method) land in parallel.cp / cp_rotate: all
    64 GPUs are spec ranks (dp_shard = 64 / cp 2 = 32), attention flash (torch's CP runs over SDPA's fused kernels)."""
    toml = (FIX / "torchtitan_llama3_8b.toml").read_text().replace(
        "context_parallel_degree = 1", 'context_parallel_degree = 2\ncontext_parallel_rotate_method = "alltoall"')
    imported = import_config_text(toml, name="cp.toml", gpus=64)
    par = imported.spec["parallel"]
    assert (par["world_size"], par["dp"], par["cp"], par["cp_rotate"]) == (64, 32, 2, "alltoall")
    assert (imported.spec["model"]["attention"] == "flash"
            and "parallelism.context_parallel_degree" not in imported.unmapped)
    with pytest.raises(ConfigImportError, match="expected one of allgather, alltoall"):
        import_config_text(toml.replace('"alltoall"', '"ring"'), name="bad.toml", gpus=64)


def test_megatron_all_to_all_context_parallelism_is_reported():
    """--cp-comm-type a2a (Ulysses: heads split, not a K/V ring) is reported in `unmapped` and predicted as the p2p
    ring; all_gather maps to cp_rotate allgather."""
    text = (FIX / "megatron_llama2_70b.sh").read_text()
    a2a = import_config_text(text.replace("--bf16", "--bf16 --cp-comm-type a2a"), name="a2a.sh")
    assert a2a.unmapped["--cp-comm-type"]["value"] == "a2a" and a2a.spec["parallel"]["cp_rotate"] == "alltoall"
    gathered = import_config_text(text.replace("--bf16", "--bf16 --cp-comm-type all_gather"), name="ag.sh")
    assert gathered.spec["parallel"]["cp_rotate"] == "allgather" and "--cp-comm-type" not in gathered.unmapped
