"""The GPU path kept honest without a GPU: no tensor factory without a device in the engine and the
parallelization code, and the placement check names what is not on ctx.device."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from backend.strategies.materialize import check_placement, misplaced

ROOT = Path(__file__).resolve().parents[2]
SCANNED = [*sorted((ROOT / "backend/engine").glob("*.py")), *sorted((ROOT / "backend/strategies").glob("*.py")),
           ROOT / "backend/torch_compat.py"]
FACTORIES = {"zeros", "ones", "empty", "full", "arange", "tensor", "randn", "rand", "randint", "randperm",
             "linspace", "logspace", "eye", "empty_strided", "as_tensor", "normal"}


def factory_calls_without_device(source: str) -> list[tuple[int, str]]:
    """(line, name) of every `torch.<factory>(...)` call without a `device=` keyword."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            out.append((node.lineno, node.func.attr))
    return out


def test_lint_catches_a_factory_without_device():
    assert (factory_calls_without_device("import torch\nx = torch.zeros(3)\ny = torch.ones(2, device=d)\n")
            == [(2, "zeros")])


@pytest.mark.parametrize("path", SCANNED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_tensor_factory_names_its_device(path):
    """On CUDA a factory without device= makes a CPU tensor next to GPU ones: a device-mismatch error, or a
    silent host sync, on the first step (see the GPU review)."""
    assert factory_calls_without_device(path.read_text()) == [], path


def test_placement_check_names_the_tensor():
    m = nn.Linear(2, 3)
    with torch.device("meta"):
        m.register_buffer("stats", torch.zeros(3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert misplaced(torch.device("cpu"), [m], opt, [torch.ones(1)]) == ["module 0 buffer stats (on meta)"]
    with pytest.raises(RuntimeError, match=r"1 tensor\(s\) not on cpu: batch tensor 1 \(on meta\)"):
        check_placement(torch.device("cpu"), [], None, [torch.ones(1), torch.ones(1, device="meta")])


def test_adamw_cpu_step_counter_is_allowed():
    m = nn.Linear(2, 2)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert misplaced(torch.device("cpu"), [m], opt) == []
