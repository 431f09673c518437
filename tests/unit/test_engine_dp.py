"""A rank's error file: its kind and an atomic write."""

import json

import torch


def test_error_kind_and_atomic_write(tmp_path):
    from backend.atomic_io import write_json_atomic
    from backend.runtime.entry import is_oom

    assert is_oom(MemoryError("x")) and is_oom(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_oom(RuntimeError("Connection closed by peer"))
    write_json_atomic(tmp_path / "a.json", {"rank": 1})
    assert json.loads((tmp_path / "a.json").read_text()) == {"rank": 1} and [p.name for p in tmp_path.iterdir()] == ["a.json"]
