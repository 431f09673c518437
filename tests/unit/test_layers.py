"""The layers of the code, read from the source with `ast` (every import, lazy ones inside functions and
TYPE_CHECKING ones included): no import cycles, no private name imported across modules, every import of a project
module resolves, no two packages import each other, and each layer imports only the layers below it
(docs/ARCHITECTURE.md, "Layers"). The graph is that of /work/shared/tools/import_graph.py, over backend/, db/,
dashboard/, app.py and benchmarks/."""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("backend", "db", "dashboard", "benchmarks")
SCRIPTS = ("app.py",)

LAYERS = (
    ("entry points: scripts, the dashboard, the CLI",
     ("benchmarks", "app", "dashboard", "backend.cli", "backend.__main__")),
    ("services: the queue worker, SLURM, the planner, calibration, imports of other frameworks' runs, the GPU check, "
     "sweeps, the full-size trace",
     ("backend.worker", "backend.run_folders", "backend.cluster", "backend.planner", "backend.calibration",
      "backend.importers", "backend.gpucheck", "backend.sweep", "backend.trace", "backend.number_format")),
    ("the experiment store", ("db",)),
    ("launching a run", ("backend.launch",)),
    ("inside a rank", ("backend.frameworks", "backend.engine", "backend.strategies", "backend.bench", "backend.models",
                       "backend.runtime", "backend.torch_compat")),
    ("model configs (config.json) read into spec fields, the parameters they leave out counted by the core",
     ("backend.hf",)),
    ("prediction, pure Python", ("backend.analytic",)),
    ("the spec, the result and the published shapes",
     ("backend.spec", "backend.recompute_policy", "backend.result", "backend.presets", "backend.atomic_io", "backend")),
)
"""Top to bottom: a unit imports units of its own layer (without cycles) or of the layers below."""


def unit(module: str) -> str:
    """The package-level unit a module belongs to: backend.<first level>, else its top-level name."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "backend" and len(parts) > 1 else parts[0]


@cache
def modules() -> dict[str, Path]:
    out = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if ("__pycache__" in rel.parts or rel.parts[:3] == ("db", "migrations", "versions")
                    or "results" in rel.parts):
                continue
            name = ".".join(rel.with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    for script in SCRIPTS:
        out[script.removesuffix(".py")] = ROOT / script
    return out


@cache
def tree(module: str) -> ast.Module:
    path = modules()[module]
    return ast.parse(path.read_text(), str(path))


def _package(module: str) -> str:
    return module if modules()[module].name == "__init__.py" else module.rpartition(".")[0]


@cache
def _owner(name: str) -> str | None:
    """The project module that defines `name` (the longest known prefix)."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


@cache
def imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, name imported from it or None, line) for every import of a project module."""
    out = []
    for node in ast.walk(tree(module)):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if _owner(a.name)]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = _package(module).split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if not _owner(base):
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                out += [(full, None, node.lineno)] if full in modules() else [(base, a.name, node.lineno)]
    return out


@cache
def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for module in modules():
        for target, _, _ in imports(module):
            owner = _owner(target)
            if owner != module:
                edges[module].add(owner)
    return edges


@cache
def _top_level_names(module: str) -> set[str] | None:
    """Names a module defines at its top level; None when it resolves names lazily (a module __getattr__)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            for field in ("body", "orelse", "finalbody", "handlers"):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit([n for n in getattr(node, field, []) if isinstance(n, ast.stmt)])
            for handler in getattr(node, "handlers", []):
                visit(handler.body)

    visit(tree(module).body)
    return None if "__getattr__" in names else names


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), but a package's __init__ importing its own
    submodules, which is no design cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph().get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(modules()):
        if v not in index:
            connect(v)
    return [c for c in found if not all(m == min(c, key=len) or m.startswith(min(c, key=len) + ".") for m in c)]


@pytest.mark.heavy
def test_there_are_no_import_cycles():
    assert _cycles() == []


def test_no_private_name_is_imported_across_modules():
    found = []
    for module in modules():
        aliases = {}
        for node in ast.walk(tree(module)):
            if isinstance(node, ast.Import):
                aliases.update({a.asname: a.name for a in node.names if a.asname and a.name in modules()})
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                                if f"{node.module}.{a.name}" in modules()})
        for target, name, line in imports(module):
            if name and name.startswith("_") and not name.startswith("__") and _owner(target) != module:
                found.append(f"{module}:{line} imports {target}.{name}")
        for node in ast.walk(tree(module)):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and aliases[node.value.id] != module):
                found.append(f"{module}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert found == []


def test_every_import_of_a_project_module_resolves():
    """A module moved or renamed leaves no import behind, lazy ones included (diag.saved_tensors imported a module
    the prediction core had moved, and only the GPU device ran that line)."""
    missing = []
    for module in modules():
        for target, name, line in imports(module):
            if target not in modules():
                missing.append(f"{module}:{line} imports {target}: no such module")
            elif (name is not None and name != "*" and (names := _top_level_names(target)) is not None
                    and name not in names):
                missing.append(f"{module}:{line} imports {name} from {target}, which does not define it")
    assert missing == []


def test_no_two_packages_import_each_other():
    units: dict[str, set[str]] = defaultdict(set)
    for source, targets in graph().items():
        units[unit(source)] |= {unit(t) for t in targets} - {unit(source)}
    mutual = sorted({tuple(sorted((a, b))) for a, bs in units.items() for b in bs if a in units.get(b, ())})
    assert mutual == []


def test_each_layer_imports_only_its_own_and_the_layers_below():
    layer_of = {u: i for i, (_, units) in enumerate(LAYERS) for u in units}
    unplaced = sorted({unit(m) for m in modules()} - set(layer_of))
    assert unplaced == [], f"place these in a layer of LAYERS: {unplaced}"
    upward = sorted(f"{source} ({LAYERS[layer_of[unit(source)]][0]}) imports {target} "
                    f"({LAYERS[layer_of[unit(target)]][0]})"
                    for source, targets in graph().items() for target in targets
                    if layer_of[unit(target)] < layer_of[unit(source)])
    assert upward == []


def test_the_backend_and_the_store_never_import_the_dashboard_scripts_or_tests():
    found = [f"{source} imports {target}" for source, targets in graph().items() if unit(source) != source.split(".")[0]
             or source.startswith("db") for target in targets if unit(target) in ("dashboard", "app", "benchmarks")]
    assert found == []


def test_the_store_knows_only_the_spec_and_the_result_of_the_backend():
    found = sorted(f"{source} imports {target}" for source, targets in graph().items() if source.split(".")[0] == "db"
                   for target in targets if target.startswith("backend.")
                   and not (target == "backend.result" or target.split(".")[:2] == ["backend", "spec"]))
    assert found == []


def test_dashboard_pages_are_scripts_nothing_imports():
    found = sorted(f"{source} imports {target}" for source, targets in graph().items() for target in targets
                   if target.startswith("dashboard.pages."))
    assert found == []
