"""Issue 30 item 1: real Megatron-LM launch scripts, read as data (backend/importers/shell_script.py).

Megatron-LM's own examples at a pinned commit (tests/fixtures/imports/megatron_examples/README.md: commit, paths and
git blob ids) each import, or are refused with the reason: a BERT, T5 or hybrid Mamba script is not a GPT-like model;
GPT-3 175B's script says one node of 8 GPUs for tp 8 x pp 16; Mixtral's takes its node count from SLURM_NNODES with
a default of 1, so the GPUs given on import decide. Expected parameter counts are the published ones (Mixtral 8x7B
46,702,792,704 and Llama 3 8B 8,030,261,248 from the Hugging Face Hub safetensors totals).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

import pytest

from backend.cli import main
from backend.importers import ConfigImportError, import_config, import_config_text
from backend.importers.import_result import VOCAB_SIZE
from backend.importers.shell_script import read

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "imports"
EXAMPLES = FIX / "megatron_examples"


def _blob_id(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_the_example_scripts_are_verbatim_copies():
    rows = re.findall(r"^\| `([^`]+)` \| `examples/([^`]+)` \| `([0-9a-f]{40})` \|$",
                      (EXAMPLES / "README.md").read_text(), re.M)
    assert len(rows) == 8 and "d98e8a64ddf34856e74b24714e3bedb2f5a39553" in (EXAMPLES / "README.md").read_text()
    for fixture, upstream, blob in rows:
        assert fixture == upstream and _blob_id(EXAMPLES / fixture) == blob, fixture
    assert {str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.sh")} == {r[0] for r in rows}


def _spec(name: str, **kw) -> dict:
    return import_config(EXAMPLES / name, **kw).spec


def test_llama3_8b_fp8_example_imports():
    """Arrays, `DTYPE_ARGS+=("--fp8-format hybrid" ...)` inside `if [[ "$DTYPE" == "fp8" ]]`, the MOCK-data branch
    (TOKENIZER_ARG=${3:-"MOCK"}) that holds --vocab-size 128256, `--nproc_per_node $GPUS_PER_NODE`."""
    imported = import_config(EXAMPLES / "llama/train_llama3_8b_h100_fp8.sh")
    spec = imported.spec
    assert imported.gpus == 8 and spec["parallel"]["dp"] == 8 and spec["parallel"]["strategy"] == "zero1"
    assert spec["train"]["precision"] == "fp8" and spec["model"]["seq_len"] == 8192
    assert spec["train"]["global_batch"] == 128 and spec["model"]["vocab_size"] == 128256
    assert (spec["model"]["n_layers"], spec["model"]["d_model"], spec["model"]["n_kv_heads"]) == (32, 4096, 8)
    from backend.analytic.params import count_params
    from backend.spec import ExperimentSpec

    assert count_params(ExperimentSpec.for_prediction(spec).model) == 8_030_261_248
    assert any("${PWD}" in n for n in imported.notes)  # DATA_CACHE_PATH="${PWD}/..." kept as written, said so
    assert not any("cannot know" in n for n in imported.notes)  # `if [ ! -f pretrain_gpt.py ]` only echoes and exits


def test_megatron_fsdp_example_imports_as_zero3():
    spec = _spec("megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh")
    assert (spec["parallel"]["strategy"] == "zero3" and spec["parallel"]["dp"] == 8
            and spec["train"]["precision"] == "fp8")


def test_mixtral_example_takes_its_gpus_from_the_environment_default():
    """NNODES=${SLURM_NNODES:-"1"}: 8 GPUs by the script's default cannot hold ep 8 x pp 4; the refusal says where the
    8 came from, and the GPU count given on import replaces that default (a literal --nnodes still binds)."""
    with pytest.raises(ConfigImportError) as e:
        import_config(EXAMPLES / "mixtral/train_mixtral_8x7b_distributed.sh", vocab_size=32000)
    text = str(e.value)
    assert "ep=8 does not divide dp=2" in text and "default for SLURM_NNODES" in text
    imported = import_config(EXAMPLES / "mixtral/train_mixtral_8x7b_distributed.sh", vocab_size=32000, gpus=32)
    par = imported.spec["parallel"]
    assert (par["dp"], par["tp"], par["pp"], par["ep"], imported.gpus) == (8, 1, 4, 8, 32)
    assert any("32 GPUs as given, not the launcher's 8" in n for n in imported.notes)
    from backend.analytic.params import count_params
    from backend.spec import ExperimentSpec

    assert count_params(ExperimentSpec.for_prediction(imported.spec).model) == 46_702_792_704
    with pytest.raises(ConfigImportError, match="contradicts the config's 128 GPUs"):
        import_config(FIX / "megatron_llama2_70b.sh", gpus=64)  # --nproc_per_node 8 --nnodes 16, literal


def test_gpt3_175b_example_is_refused_with_the_arithmetic_and_imports_on_16_nodes(tmp_path):
    with pytest.raises(ConfigImportError, match=re.escape(
            "dp(-1) * cp(1) * tp(8) * pp(16) != GPUs(8, the launcher's --nproc_per_node 8 x --nnodes 1)")):
        import_config(EXAMPLES / "gpt3/train_gpt3_175b_distributed.sh", vocab_size=50257)
    script = tmp_path / "175b.sh"  # "# Change for multinode config": NUM_NODES=16
    script.write_text((EXAMPLES / "gpt3/train_gpt3_175b_distributed.sh").read_text().replace("NUM_NODES=1\n",
                                                                                             "NUM_NODES=16\n"))
    spec = import_config(script, vocab_size=50257).spec
    assert (spec["parallel"]["tp"], spec["parallel"]["pp"], spec["parallel"]["dp"]) == (8, 16, 1)
    assert (spec["model"]["n_layers"], spec["model"]["d_model"], spec["model"]["seq_len"]) == (96, 12288, 2048)
    assert spec["train"]["precision"] == "fp16-mixed" and spec["train"]["global_batch"] == 1536


def test_gpt_oss_example_imports_and_names_what_it_cannot_hold():
    """`while [[ $# -gt 0 ]]` (no arguments: not entered), PP_SIZE=${WORLD_SIZE} = $(($GPUS_PER_NODE*$NUM_NODES))."""
    imported = import_config(EXAMPLES / "gptoss/02_train.sh")
    assert imported.spec["parallel"]["pp"] == 8 and imported.spec["model"]["n_experts"] == 4
    assert {"--softmax-type", "--window-size", "--quick-geglu"} <= set(imported.unmapped)


@pytest.mark.parametrize("name, kind", [("bert/train_bert_340m_distributed.sh",
                                         "pretrain_bert.py trains a BERT encoder"),
                                        ("t5/train_t5_220m_distributed.sh",
                                         "pretrain_t5.py trains a T5 encoder-decoder"),
                                        ("mamba/train.sh", "pretrain_hybrid.py trains a hybrid Mamba-Transformer")])
def test_examples_that_are_not_gpt_like_are_refused_by_name(capsys, name, kind):
    assert main(["import-config", str(EXAMPLES / name)]) == 2
    err = capsys.readouterr().err
    assert kind in err and "decoder-only GPT-like" in err and "Traceback" not in err


def test_no_vocabulary_in_the_script_asks_for_one(capsys):
    """Megatron reads the vocabulary from the tokenizer: the import says what it needs (ConfigImportError.needs), the
    CLI asks for --vocab or --model-config, and either gives it."""
    path = str(EXAMPLES / "mixtral/train_mixtral_8x7b_distributed.sh")
    with pytest.raises(ConfigImportError) as e:
        import_config(path, gpus=32)
    assert e.value.needs == (VOCAB_SIZE,) and "the vocabulary size is unknown" in str(e.value)
    assert main(["import-config", path, "--gpus", "32"]) == 2
    assert "give the vocabulary size with --vocab N, or the model's config.json with --model-config" in \
        capsys.readouterr().err
    assert main(["import-config", path, "--gpus", "32", "--vocab", "32000", "--json"]) == 0
    assert '"vocab_size": 32000' in capsys.readouterr().out
    assert import_config(path, gpus=32, model_config=FIX.parent / "hf" / "mixtral-8x7b.json").spec["model"][
        "vocab_size"] == 32000
    with pytest.raises(ConfigImportError, match=r"given \(50,000\) contradicts the config's 128,256"):
        import_config(EXAMPLES / "llama/train_llama3_8b_h100_fp8.sh", vocab_size=50000)
    with pytest.raises(ConfigImportError, match="for Megatron-LM / NeMo configs"):
        import_config(FIX / "torchtitan_llama3_8b.toml", gpus=8, vocab_size=50000)


ISSUE_SCRIPT = """#!/bin/bash
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=8
NNODES=${NNODES:-2}
DISTRIBUTED_ARGS=(--nproc_per_node $GPUS_PER_NODE --nnodes $NNODES)
MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096   # Llama-3-8B shape
    --num-attention-heads 32 --group-query-attention --num-query-groups 8
    --ffn-hidden-size 14336 --seq-length 8192 --max-position-embeddings 8192
    --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
    --disable-bias-linear --vocab-size 128256
)
GPT_ARGS="--micro-batch-size 1 \\
    --global-batch-size $((GPUS_PER_NODE * NNODES * 4)) --bf16"
TRAINING_ARGS=(--tensor-model-parallel-size 2 --context-parallel-size 2)
TRAINING_ARGS+=(--use-distributed-optimizer)
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${MODEL_ARGS[@]} ${TRAINING_ARGS[@]} $GPT_ARGS \\
    --save "$CHECKPOINT" 2>&1 | tee train.log
"""


def test_the_issue_script_imports():
    """The issue's refusal: "'${MODEL_ARGS[@]}' is not an argument", and the same for a `GPT_ARGS="..."` string."""
    imported = import_config_text(ISSUE_SCRIPT, name="pretrain.sh")
    par, train = imported.spec["parallel"], imported.spec["train"]
    assert imported.gpus == 16 and (par["dp"], par["cp"], par["tp"], par["strategy"]) == (4, 2, 2, "zero1")
    assert train["global_batch"] == 64 and train["micro_batch"] == 1 and train["precision"] == "bf16-mixed"
    from backend.cli.import_config import summary_text

    assert "world 16 = dp 4 x cp 2 x tp 2 x pp 1, ep 1" in summary_text(imported)


def _words(script: str) -> list[str]:
    return read(script).words


def test_bash_semantics_the_reader_follows():
    assert _words('A=(--a "x y" \'z\')\nB=("${A[@]}" --b)\nrun.py "${B[@]}"\n') == ["run.py", "--a", "x y", "z", "--b"]
    assert _words('A=("--s \'1,2\'" --t)\nrun.py ${A[@]}\n') == ["run.py", "--s", "'1,2'", "--t"]  # unquoted: split
    assert _words('S="--a 1\n  --b 2"\nrun.py $S "$S"\n') == ["run.py", "--a", "1", "--b", "2", "--a 1\n  --b 2"]
    assert _words("X=${X:-4}\nY=${Y:=5}\nrun.py --x $X --y $Y --z ${Z:+no} --n $((X * Y + 1))\n") == \
        ["run.py", "--x", "4", "--y", "5", "--z", "--n", "21"]
    assert _words('A=1\nif [ "$A" = 2 ]; then B=two\nelif [[ $A == 1 && -z "$UNSET" ]]; then B=one\nelse B=none\nfi\n'
                  'case "$B" in\n  tw*) C=x ;;\n  one|uno) C=y ;;\nesac\nrun.py --b $B --c $C\n') == \
        ["run.py", "--b", "one", "--c", "y"]
    assert _words('while [[ $# -gt 0 ]]; do shift; done\nexport E=1 F\nunset E\nrun.py --e ${E:-gone} \\\n  --f\n') == \
        ["run.py", "--e", "gone", "--f"]
    assert _words("cat <<EOF\npretrain_gpt.py --num-layers 1\nEOF\nrun.py --x 1\n") == ["run.py", "--x", "1"]
    assert (_words("--num-layers 2\n--hidden-size 64 # a file of flags\n")
            == ["--num-layers", "2", "--hidden-size", "64"])
    assert (_words("python other.py\ntorchrun a/pretrain_gpt.py --x\npython eval.py\n")
            == ["torchrun", "a/pretrain_gpt.py", "--x"])


def test_what_the_reader_cannot_know_is_kept_as_written_and_said(tmp_path):
    marker = tmp_path / "pwned"
    script = (f'N=$(touch {marker}; nproc)\nL=`touch {marker}`\nif [ -f /etc/passwd ]; then TP=8; fi\n'
              f'run.py --n $N --l $L --tp ${{TP:-1}} --data $1 --x "$HOME/x"\n')
    command = read(script)
    assert command.words == ["run.py", "--n", f"$(touch {marker}; nproc)", "--l", f"$(touch {marker})", "--tp", "1",
                             "--data", "${1}", "--x", "${HOME}/x"]
    assert not marker.exists()
    assert any("line 3: the if tests what a script read as data cannot know" in n and "it sets TP" in n
               for n in command.notes)
    assert any("kept as written" in n and "${1}" in n for n in command.notes)


def test_nothing_in_a_script_is_run(tmp_path, monkeypatch):
    """No subprocess, no os.system / exec: every way to start a program raises while a hostile script is read."""
    def refuse(*a, **k):
        raise AssertionError("the reader started a program")

    for name in ("Popen", "run", "call", "check_call", "check_output"):
        monkeypatch.setattr(subprocess, name, refuse)
    for name in ("system", "popen", "execv", "execve", "execvp", "spawnv", "fork"):
        monkeypatch.setattr(os, name, refuse, raising=False)
    marker = tmp_path / "ran"
    script = (f"touch {marker}\neval 'touch {marker}'\nsource ./evil.sh\nX=$(touch {marker})\n"
              f"f() {{ touch {marker}; }}\nf\n`touch {marker}`\n" + ISSUE_SCRIPT)
    imported = import_config_text(script, name="evil.sh")
    assert imported.gpus == 16 and not marker.exists()


@pytest.mark.parametrize("script, message", [
    ("if true; then\n" * 1000 + "fi\n" * 1000, "nested more than 64 deep"),
    ("A=(x)\n" + 'A+=("${A[@]}" "${A[@]}")\n' * 40 + "run.py ${A[@]}\n", "expand to more than"),
    ('X="unclosed\nrun.py --a\n', 'quote is never closed'),
    ("run.py ${A\n", "never closed"),
    ("A=(--x\nrun.py\n", "never closed"),
    ("if true; then\nrun.py --x\n", "the script ends before 'fi'"),
    ("A=1\n" * 70_000, "over the 262,144-byte limit for a launch script"),
    # found by fuzzing the reader: a flag given two values, or a variable the script never sets, met a converter that
    # was never called (a TypeError / ValueError traceback)
    ("run.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
     "--vocab-size 100 --normalization RMSNorm LayerNorm\n", "--normalization=.*expected one of"),
    ("run.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 "
     "--vocab-size 100 --kv-channels $KV\n", r"--kv-channels='\$\{KV\}': expected an integer"),
])
@pytest.mark.heavy
def test_hostile_or_broken_scripts_are_refused_with_the_reason(script, message):
    with pytest.raises(ConfigImportError, match=message):
        import_config_text(script, name="bad.sh", fmt="megatron", gpus=8)


def test_import_summary_names_every_degree(capsys):
    """"16 GPUs: zero1, dp 1 x tp 4 x pp 2" for a cp 2 layout left cp out; every degree is named now."""
    from dashboard.import_view import summary_line

    imported = import_config(FIX / "megatron_llama2_70b.sh")
    assert "128 GPUs = dp 2 x cp 2 x tp 8 x pp 4, ep 1: zero1" in summary_line(imported)
    assert main(["import-config", str(FIX / "megatron_llama2_70b.sh")]) == 0
    assert "world 128 = dp 2 x cp 2 x tp 8 x pp 4, ep 1" in capsys.readouterr().out


MEGATRON_BASE = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings "
                 "1024 --micro-batch-size 1 --global-batch-size 8 --vocab-size 32000 ")


def test_bf16_beside_fp16_is_refused_as_megatron_refuses_it():
    """--bf16 --fp16 imported silently as bf16-mixed; Megatron asserts not both (arguments.py, under args.fp16)."""
    with pytest.raises(ConfigImportError, match="--fp16 and --bf16 both given"):
        import_config_text(MEGATRON_BASE + "--bf16 --fp16", name="a.sh", gpus=4)


def test_recompute_method_without_full_granularity_is_reported_not_dropped():
    """--recompute-method / --recompute-num-layers without --recompute-granularity full vanished from the import (in
    neither the spec, "ignored" nor "unmapped"); under selective Megatron refuses a method."""
    imported = import_config_text(MEGATRON_BASE + "--bf16 --recompute-method block --recompute-num-layers 2",
                                  name="a.sh", gpus=4)
    assert imported.spec["train"]["recompute"] == "none"
    for flag, value in (("--recompute-method", "block"), ("--recompute-num-layers", 2)):
        assert imported.ignored[flag]["value"] == value and "--recompute-granularity full" in \
            imported.ignored[flag]["reason"]
    with pytest.raises(ConfigImportError, match="--recompute-method block with --recompute-granularity selective"):
        import_config_text(MEGATRON_BASE + "--bf16 --recompute-granularity selective --recompute-method block",
                           name="a.sh", gpus=4)
