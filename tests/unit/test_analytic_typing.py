"""The prediction core names its types (issue 33, "a core a newcomer can read"): no parameter or field of
backend/analytic that holds a spec, a model, a layout, a hardware profile, a stack or a rank's parts is annotated
`Any`, so a reader can jump to its definition. Read from the source with `ast` (no imports); the Protocols that stand
in where several classes are passed are checked against those classes."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ANALYTIC = ROOT / "backend" / "analytic"

TYPED_NAMES = frozenset({
    "m", "spec", "model", "layout", "lay", "train", "parallel", "hw", "stack", "stages", "acts", "parts", "prt",
    "position", "pos", "key", "shape", "pp_rank", "rank",
})
"""Parameter and field names that hold a spec (ExperimentSpec, ModelSpec, TrainSpec, ParallelSpec), a Layout, a
Hardware profile, a StackMemory, a StageComposition, ActivationMoments, RankParts, a RankPosition, a ModelKey, a
LayerShape, or a rank index (`Num`: one or many layouts); `m` is a ModelSpec or a GEMM's row count (`Num`)."""


def _is_bare_any(node: ast.expr | None) -> bool:
    """`Any`, `typing.Any`, "Any", or a union / Optional with Any as a member: the annotation says nothing. Any inside
    a container (dict[str, Any]: a JSON mapping) is left alone."""
    if node is None:
        return False
    if isinstance(node, ast.Name):
        return node.id == "Any"
    if isinstance(node, ast.Attribute):
        return node.attr == "Any"
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return _is_bare_any(ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            return False
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _is_bare_any(node.left) or _is_bare_any(node.right)
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name | ast.Attribute):
        outer = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
        if outer in ("Optional", "Union"):
            members = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return any(_is_bare_any(x) for x in members)
    return False


def untyped(root: Path) -> list[str]:
    """'path:line name' for every parameter or class field named in TYPED_NAMES annotated Any, under `root`."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                    if arg.arg in TYPED_NAMES and _is_bare_any(arg.annotation):
                        out.append(f"{rel}:{arg.lineno} {node.name}({arg.arg}: {ast.unparse(arg.annotation)})")
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                            and item.target.id in TYPED_NAMES and _is_bare_any(item.annotation)):
                        out.append(f"{rel}:{item.lineno} {node.name}.{item.target.id}: "
                                   f"{ast.unparse(item.annotation)}")
    return out


def test_no_spec_model_or_layout_parameter_is_any():
    found = untyped(ANALYTIC)
    assert not found, ("annotated Any where a type exists (ExperimentSpec, ModelSpec, Layout, Hardware, StackMemory, "
                       "params.ModelShape, scalar_or_array.Num, ...):\n" + "\n".join(found))


def test_the_check_sees_each_spelling_of_any(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text(
        "import typing\nfrom typing import Any, Optional\n\n"
        "def f(spec: Any, model: typing.Any, layout: 'Any', hw: Any | None, m: Optional[Any], n: Any,\n"
        "      routing: dict[str, Any], key: int) -> Any: ...\n\n"
        "class C:\n    stack: Any = None\n    rows: Any = None\n")
    found = untyped(tmp_path)
    assert [f.split(" ", 1)[1].split(":")[0] for f in found] == [
        "f(spec", "f(model", "f(layout", "f(hw", "f(m", "C.stack"]


def _members(protocol: type) -> set[str]:
    return {name for klass in protocol.__mro__ if klass.__module__ != "typing" and klass is not object
            for name in vars(klass) if not name.startswith("_")}


def test_the_protocols_name_what_their_classes_hold():
    from backend.analytic.layout import Layout
    from backend.analytic.memory.activations import LayerShape
    from backend.analytic.memory.family_bytes import AttentionShape
    from backend.analytic.model_shape import ModelShape
    from backend.analytic.params import ModelKey
    from backend.analytic.stack_memory import DpGroups, StackSource
    from backend.spec import ExperimentSpec, ModelSpec

    def has(klass: type, name: str) -> bool:
        fields = getattr(klass, "model_fields", None) or getattr(klass, "__dataclass_fields__", None) or {}
        return name in fields or hasattr(klass, name) or name in getattr(klass, "_fields", ())

    for protocol, classes in ((ModelShape, (ModelSpec, ModelKey)), (AttentionShape, (LayerShape,)),
                              (DpGroups, (Layout,)), (StackSource, (ExperimentSpec,))):
        members = _members(protocol)
        assert members, protocol
        for klass in classes:
            missing = sorted(n for n in members if not has(klass, n))
            assert not missing, f"{klass.__name__} lacks {protocol.__name__}'s {missing}"
