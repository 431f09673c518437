"""torchtitan applies its [float8] section only with the float8 converter (model.converters = ["float8"]): without
it the section's recipe and float8 all-gather vanished from the import (in neither the spec, "ignored" nor
"unmapped"); they are reported as ignored, with the reason."""

from __future__ import annotations

from backend.importers import import_config_text

TOML = """\
[model]
name = "llama3"
flavor = "8B"
{converters}
[training]
local_batch_size = 1
seq_len = 2048
[parallelism]
data_parallel_shard_degree = -1
[float8]
enable_fsdp_float8_all_gather = true
recipe_name = "rowwise"
"""


def test_float8_settings_without_the_converter_are_reported_as_ignored():
    imported = import_config_text(TOML.format(converters=""), name="job.toml", gpus=8)
    assert imported.spec["train"]["precision"] == "bf16-mixed"
    for key, value in (("float8.recipe_name", "rowwise"), ("float8.enable_fsdp_float8_all_gather", True)):
        assert imported.ignored[key]["value"] == value, imported.ignored
        assert "model.converters" in imported.ignored[key]["reason"]


def test_with_the_converter_they_are_the_spec():
    imported = import_config_text(TOML.format(converters='converters = ["float8"]'), name="job.toml", gpus=8)
    train = imported.spec["train"]
    assert (train["precision"], train["fp8_recipe"], train["fp8_all_gather"]) == ("fp8", "rowwise", True)
    assert "float8.recipe_name" not in imported.ignored
