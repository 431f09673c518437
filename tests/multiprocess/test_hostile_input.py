"""Hostile files given to the CLI program: a wrong config.json or an odd spec file exits 2 with the reason, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from backend.hf_config import HFConfigError, from_hf_config
from db.session import REPO
LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
         "intermediate_size": 64, "max_position_embeddings": 16, "hidden_act": "silu"}


def test_wrong_typed_or_incomplete_config_json_is_an_error_not_a_traceback(tmp_path):
    for bad, said in ((dict(LLAMA, hidden_size="big"), "hidden_size='big' must be an integer >= 1"),
                      (dict(LLAMA, num_attention_heads=[2]), "num_attention_heads=[2]"),
                      ({k: v for k, v in LLAMA.items() if k != "vocab_size"}, "config.json lacks vocab_size"),
                      (dict(LLAMA, tie_word_embeddings="yes"), "must be true or false")):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(bad))
        done = subprocess.run([sys.executable, "-m", "backend", "estimate", "--hf-config", str(path), "--world", "2"],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr[-500:]
    with pytest.raises(HFConfigError, match="a JSON object"):
        from_hf_config([1, 2])  # type: ignore[arg-type]


def test_deeply_nested_or_odd_spec_files_exit_2_with_the_reason(tmp_path):
    cases = {"deep.json": ('{"model": ' * 50_000 + "{}" + "}" * 50_000, "nests too deep"),
             "deep2.json": (json.dumps({"model": {"source": json.loads("[" * 60 + "]" * 60)}}), "levels deep"),
             "list.json": ("[1, 2]", "not an object of spec sections"),
             "section.json": ('{"parallel": 5}', "section 'parallel' is a JSON int")}
    for name, (text, said) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        done = subprocess.run([sys.executable, "-m", "backend", "estimate", "--spec", str(path), "--world", "2"],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, (name, done.stderr[-500:])
