"""The runtime's layering, read from the source with `ast`: the rank protocol lives in one module, the in-rank side
(engine, strategies, frameworks) does not import the launcher, frameworks use only the engine's public API
(backend/engine/__init__.py), and the cycles cut in issue 23 stay cut."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = "backend/runtime/protocol.py"
PROTOCOL_WORDS = ("SHARDLAB_PROGRESS", "SHARDLAB_FAULT", ".error.json", ".stack.txt", ".progress")


def _modules(folder: str) -> dict[str, ast.Module]:
    return {str(p.relative_to(ROOT)): ast.parse(p.read_text(), str(p)) for p in sorted((ROOT / folder).rglob("*.py"))}


def _imports(tree: ast.Module) -> set[str]:
    """Every module named by an import, including lazy ones inside functions (`from a.b import c` -> a.b.c, a.b)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _offenders(folder: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    return [f"{path} imports {name}" for path, tree in _modules(folder).items() for name in sorted(_imports(tree))
            if name.startswith(forbidden) and name not in allowed]


def _code_strings(tree: ast.Module) -> list[str]:
    """String constants that are code, not documentation (bare string statements are docstrings)."""
    docs = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


@pytest.mark.heavy
def test_only_the_protocol_module_names_the_protocol_files_and_lines():
    found = [f"{path}: {s!r}" for folder in ("backend", "db", "dashboard") for path, tree in _modules(folder).items()
             if path != PROTOCOL for s in _code_strings(tree)
             if s == "ranks.json" or any(w in s for w in PROTOCOL_WORDS)]
    assert not found, found


def test_in_rank_code_does_not_import_the_launcher():
    assert not _offenders("backend/engine", ("backend.launch",))
    assert not _offenders("backend/strategies", ("backend.launch", "backend.engine"))
    assert not _offenders("backend/frameworks", ("backend.launch",))


def test_frameworks_and_trace_use_the_engines_public_api_only():
    public = ("backend.engine",) + tuple(f"backend.engine.{name}" for name in _engine_public_names())
    assert not _offenders("backend/frameworks", ("backend.engine",), allowed=public)
    assert not _offenders("backend/trace", ("backend.engine",), allowed=public)


def test_the_runtime_imports_neither_side():
    assert not _offenders("backend/runtime", ("backend.engine", "backend.launch", "backend.frameworks",
                                              "backend.strategies", "backend.cluster", "db"))


def test_cut_cycles_stay_cut():
    trace_compat = ast.parse((ROOT / "backend/trace/torch_private.py").read_text())
    assert not [n for n in _imports(trace_compat) if n.startswith("backend.trace.ddp_standin")]
    sweep = ast.parse((ROOT / "backend/sweep.py").read_text())
    assert not [n for n in _imports(sweep) if n.startswith("backend.cli")]


def _engine_public_names() -> list[str]:
    import backend.engine

    return list(backend.engine.__all__)
