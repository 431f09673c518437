"""Issue 31 items 4 and 9e: configs nested 1,000 deep (2-6 KB of JSON, TOML or YAML) are refused with the reason, exit
2, never a RecursionError; `--format` imports a file whose kind auto-detection cannot tell."""

from __future__ import annotations

import pytest

from backend.cli import main
from backend.importers import ConfigImportError, import_config_text

DEEP = 1000
NESTED = {  # file name -> text nested DEEP levels (each 2-6 KB)
    "deep.json": '{"a":' * DEEP + "1" + "}" * DEEP,  # json.loads in detect()
    "ds_config.json": '{"train_batch_size": 8, "zero_optimization": ' + '{"a":' * DEEP + "1" + "}" * (DEEP + 1),
    "job.toml": "[model]\nname = " + "[" * DEEP + "]" * DEEP + "\n",  # tomllib in torchtitan_toml.parse
    "inline.toml": "[training]\nx = " + "{a=" * DEEP + "1" + "}" * DEEP + "\n",
    "nemo.yaml": "model:\n  x:\n    " + "- " * DEEP + "1\n",  # yaml.safe_load (block sequences on one line)
    "flow.yaml": "model: " + "[" * DEEP + "]" * DEEP + "\n",
    "config.yaml": "_wandb: {value: 1}\nparallelism: " + "[" * DEEP + "]" * DEEP + "\n",  # the W&B sniffing path
}


@pytest.mark.parametrize("name", sorted(NESTED))
@pytest.mark.parametrize("fmt", [None, "torchtitan", "megatron", "deepspeed"])
@pytest.mark.heavy
def test_a_config_nested_1000_deep_is_refused_with_the_reason(tmp_path, capsys, name, fmt):
    text = NESTED[name]
    assert 2_000 <= len(text) <= 6_200
    path = tmp_path / name
    path.write_text(text)
    assert main(["import-config", str(path), *(["--format", fmt] if fmt else []), "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "RecursionError" not in err
    if fmt is None or (fmt, name.rsplit(".", 1)[1]) in {("torchtitan", "toml"), ("megatron", "yaml"),
                                                        ("torchtitan", "json"), ("deepspeed", "json")}:
        assert "nests too deep to parse: a config nests at most 32 levels" in err or "levels deep, over" in err, err


@pytest.mark.parametrize("name, text", [
    ("job.toml", "[model]\nname = " + "[" * 40 + "]" * 40 + "\n"),
    ("nemo.yaml", "model:\n  x: " + "[" * 40 + "]" * 40 + "\n"),
    ("deep.json", '{"training": 1, "parallelism": ' + '{"a":' * 40 + "1" + "}" * 41),
])
def test_a_config_deeper_than_the_spec_limit_says_how_deep(name, text):
    """Parsed, but deeper than any config (spec/user_text.MAX_JSON_DEPTH = 32): refused by depth, as a --spec is."""
    with pytest.raises(ConfigImportError, match=r"nests 4\d levels deep, over the limit of 32"):
        import_config_text(text, name=name, gpus=8)


TOML_WITHOUT_SECTIONS = """model.name = "llama3"
model.flavor = "8B"
training.local_batch_size = 1
training.seq_len = 8192
parallelism.data_parallel_shard_degree = -1
"""


def test_format_overrides_a_failed_detection(tmp_path, capsys):
    """A torchtitan TOML written with dotted keys (no [model] header) under a name without .toml: auto-detection cannot
    tell it; --format torchtitan reads it (before: the same 'give --format' error, with --format given)."""
    path = tmp_path / "job.cfg"
    path.write_text(TOML_WITHOUT_SECTIONS)
    assert main(["import-config", str(path), "--gpus", "8"]) == 2
    assert "give --format" in capsys.readouterr().err
    assert main(["import-config", str(path), "--gpus", "8", "--format", "torchtitan", "--json"]) == 0
    assert '"source_format": "torchtitan-toml"' in capsys.readouterr().out
    imported = import_config_text(TOML_WITHOUT_SECTIONS, name="job.cfg", fmt="torchtitan", gpus=8)
    assert imported.spec["parallel"]["dp"] == 8 and imported.spec["model"]["seq_len"] == 8192
    with pytest.raises(ConfigImportError, match="is not an argument|no --arguments|no training command"):
        import_config_text(TOML_WITHOUT_SECTIONS, name="job.cfg", fmt="megatron", gpus=8)
