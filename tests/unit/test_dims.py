"""Issue 33: one table of parallel dimensions (backend/spec/dims.py). A throw-away dimension "xp" added to the table
is picked up by the spec, the CLI, sweeps, the form, the planner's degree space, the mesh, the rank layout, the run
rules' view, the store and the export, with no other change; and the real table gives exactly the contracts it
replaced (flags, JSON keys, CSV columns, mesh, coords)."""

from __future__ import annotations

import argparse
import re
from enum import StrEnum
from pathlib import Path

import pytest
from pydantic import ValidationError
from sqlalchemy import select, update

from backend.spec import dims
from backend.spec.parallel_spec import ParallelHead, ParallelSpec


class XpMode(StrEnum):
    RING = "ring"
    TREE = "tree"


XP = dims.Dim("xp", dims.SpecField("xp", int, 1, "A throw-away degree.", ge=1, le=dims.MAX_WORLD, flag="--xp",
                                   widget=dims.Widget("XP degree", help="a test's dimension")),
              options=(dims.SpecField("xp_mode", XpMode, XpMode.RING, "How xp talks.", flag="--xp-mode",
                                      widget=dims.Widget("XP mode", words={"ring": "round a ring"})),),
              rank_order=4, mesh="xp")
"""In the world, a mesh dimension of its own, fastest-varying."""
XP_FOLDED = dims.Dim("xf", dims.SpecField("xf", int, 1, "A degree carved out of dp x tp, as Megatron's expert "
                                          "tensor parallelism is (MoE parallel folding).", ge=1, le=dims.MAX_WORLD,
                                          flag="--xf"),
                     in_world=False, carved_from=("dp", "tp"))
"""Not in the world: carved out of the dp x tp ranks (how etp, issue 35, folds)."""
WITH_XP = (*dims.DIMS, XP)

MODEL = {"vocab_size": 256, "d_model": 64, "n_layers": 8, "n_heads": 4, "seq_len": 32, "attention": "flash",
         "n_experts": 4}


# ---- the real table gives exactly what was written by hand before it ------------------------------------------------

def test_the_real_table_keeps_the_contracts():
    from backend.engine.mesh import MESH_DIMS
    from backend.spec.fields import FLAGS, SWITCHES
    from backend.sweep import PURE_DEGREE, WORLD_PATHS
    from db.export import EXP_COLUMNS, NOT_APPLICABLE
    from db.queries import ROW_KEYS

    # issue 35 added etp last: every column / key before it keeps its place
    assert dims.degree_names(dims.DIMS) == ("dp", "tp", "pp", "ep", "cp", "etp")
    assert {f: (s, n) for f, (s, n, _) in FLAGS.items() if s == "parallel" and n not in ("strategy", "world_size",
                                                                                          "offload")} == {
        "--dp": ("parallel", "dp"), "--tp": ("parallel", "tp"), "--pp": ("parallel", "pp"), "--ep": ("parallel", "ep"),
        "--cp": ("parallel", "cp"), "--cp-rotate": ("parallel", "cp_rotate"), "--schedule": ("parallel", "pp_schedule"),
        "--virtual-stages": ("parallel", "virtual_stages"), "--etp": ("parallel", "etp")}
    assert {f: (s.name, s.flag_kind) for f, s in SWITCHES.items()} == {
        "--sequence-parallel": ("sequence_parallel", "switch"), "--cp-load-balance": ("cp_load_balance", "toggle")}
    assert list(ParallelSpec.model_fields) == ["strategy", "world_size", "dp", "tp", "sequence_parallel", "pp",
                                               "pp_schedule", "virtual_stages", "ep", "cp", "cp_rotate",
                                               "cp_load_balance", "etp", "offload"]
    assert EXP_COLUMNS[:21] == ["id", "name", "status", "kind", "framework", "stack", "strategy", "world_size", "dp",
                                "tp", "pp", "ep", "cp", "cp_rotate", "cp_load_balance", "zero_stage", "schedule",
                                "microbatches", "virtual_stages", "sequence_parallel", "etp"]
    assert ROW_KEYS[:18] == ("id", "name", "status", "strategy", "world_size", "dp", "tp", "pp", "ep", "cp",
                             "cp_rotate", "cp_load_balance", "zero_stage", "schedule", "microbatches", "virtual_stages",
                             "sequence_parallel", "etp")
    assert NOT_APPLICABLE == {"schedule": "pp", "virtual_stages": "pp", "sequence_parallel": "tp", "top_k": "n_experts",
                              "cp_rotate": "cp", "cp_load_balance": "cp"}
    assert MESH_DIMS == ("pp", "dp", "tp") and PURE_DEGREE == {"tp": "tp", "pp": "pp", "ep": "ep"}
    assert WORLD_PATHS == {"parallel.world_size", "parallel.dp", "parallel.tp", "parallel.pp", "parallel.ep",
                           "parallel.cp", "parallel.strategy"}


def _old_coords(tp: int, cp: int, dp: int, ep: int, rank: int) -> dict[str, int]:
    """ParallelSpec.coords as written by hand before the table (6711c58)."""
    c = {"pp": rank // (dp * cp * tp), "dp": (rank // (tp * cp)) % dp}
    if cp > 1:
        c["cp"] = (rank // tp) % cp
    c["tp"] = rank % tp
    c["ep"] = ((rank // tp) % (dp * cp)) % ep
    return c


@pytest.mark.parametrize("pp,dp,cp,tp,ep", [(1, 2, 1, 1, 1), (2, 2, 2, 2, 2), (1, 1, 4, 1, 4), (2, 3, 2, 1, 3),
                                             (3, 2, 1, 2, 1), (1, 4, 2, 1, 8)])
def test_coords_and_the_mesh_are_the_layout_they_were(pp, dp, cp, tp, ep):
    p = ParallelSpec.model_construct(**{**ParallelSpec().model_dump(), "pp": pp, "dp": dp, "cp": cp, "tp": tp,
                                        "ep": ep})
    for rank in range(pp * dp * cp * tp):
        got = p.coords(rank)
        assert got == _old_coords(tp, cp, dp, ep, rank) and list(got) == list(_old_coords(tp, cp, dp, ep, rank))
        assert p.rank_at(**{k: v for k, v in got.items() if k != "ep"}) == rank
        assert got["ep"] == p.data_parallel_index(rank) % ep
    assert dims.mesh_shape(dims.DIMS, p.degrees()) == (pp, dp * cp, tp)


# ---- a throw-away dimension ------------------------------------------------------------------------------------------

def test_the_spec_takes_a_new_dimension_with_its_bounds_default_and_docstring():
    Spec = dims.spec_model(WITH_XP, ParallelHead, "ParallelWithXp")
    assert Spec().xp == 1 and Spec(xp=4, xp_mode="tree").xp_mode == XpMode.TREE
    schema = Spec.model_json_schema()["properties"]["xp"]
    assert schema["description"] == "A throw-away degree." and schema["minimum"] == 1 and schema["default"] == 1
    for bad in (0, True, "two"):
        with pytest.raises(ValidationError):
            Spec(xp=bad)
    with pytest.raises(ValidationError):
        Spec(xp_mode="star")
    assert list(Spec.model_fields)[-2:] == ["xp", "xp_mode"]


def test_the_cli_and_sweeps_take_a_new_dimension(monkeypatch):
    from backend.cli import spec_flags
    from backend.spec.fields import FLAGS, dim_flags

    assert dim_flags(WITH_XP)["--xp"] == ("parallel", "xp", int)
    assert dim_flags(WITH_XP)["--xp-mode"] == ("parallel", "xp_mode", ["ring", "tree"])
    monkeypatch.setattr(spec_flags, "FLAGS", {**FLAGS, **dim_flags(WITH_XP)})
    parser = argparse.ArgumentParser()
    spec_flags.add_spec_flags(parser)
    args = parser.parse_args(["--xp", "2", "--xp-mode", "tree", "--tp", "2"])
    assert spec_flags.spec_dict_from_args(args)["parallel"] == {"xp": 2, "xp_mode": "tree", "tp": 2}
    assert "parallel.xp" in dims.world_paths(WITH_XP) and "parallel.xp_mode" not in dims.world_paths(WITH_XP)


def test_the_form_shows_a_new_dimension(monkeypatch):
    from dashboard import spec_form as sf

    fields = dims.form_fields(WITH_XP)
    assert [f.name for f in fields] == ["tp", "pp", "ep", "cp", "etp", "xp", "sequence_parallel", "pp_schedule",
                                        "virtual_stages", "cp_rotate", "cp_load_balance", "xp_mode"]
    monkeypatch.setattr(sf, "PARALLEL_FIELDS", fields)
    monkeypatch.setattr(sf, "PARALLEL_KEYS", ("strategy", "world_size", *(f.name for f in fields)))
    form = sf.default_form()
    assert form["xp"] == 1 and form["xp_mode"] == "ring"
    assert sf.form_to_spec_dict(form | {"xp": 2})["parallel"]["xp"] == 2


def test_the_planner_space_searches_a_new_dimension():
    from backend.planner.space import Limits, degree_space
    from backend.spec import ModelSpec

    model = ModelSpec(**MODEL)
    real = degree_space(dims.DIMS, model, gpus=8, gpus_per_node=8, limits=Limits())
    with_xp = degree_space(WITH_XP, model, gpus=8, gpus_per_node=8, limits=Limits())
    for point in with_xp:
        assert point.degrees["dp"] * point.degrees["tp"] * point.degrees["pp"] * point.degrees["cp"] \
            * point.degrees["xp"] == 8
        dp_cp = point.degrees["dp"] * point.degrees["cp"]
        assert all(dp_cp % ep == 0 and 4 % ep == 0 and point.degrees["tp"] % etp == 0 and (ep > 1 or etp == 1)
                   for ep, etp in point.carved)
    assert {p.degrees["xp"] for p in with_xp} == {1, 2, 4, 8}
    assert [p for p in with_xp if p.degrees["xp"] == 1] == [
        type(p)({**p.degrees, "xp": 1}, p.carved, p.schedules) for p in real]
    folded = degree_space((*dims.DIMS, XP_FOLDED), model, gpus=8, gpus_per_node=8, limits=Limits())
    for p, r in zip(folded, real, strict=True):  # xf carved out of dp x tp, beside ep carved out of dp x cp
        dp_tp = p.degrees["dp"] * p.degrees["tp"]
        assert p.degrees == r.degrees
        assert p.carved == [(ep, etp, xf) for ep, etp in r.carved for xf in range(1, dp_tp + 1) if dp_tp % xf == 0]


def test_the_mesh_the_rank_layout_and_the_run_rules_take_a_new_dimension():
    from backend.spec.run_rules import LayoutView

    degrees = {"dp": 2, "tp": 2, "pp": 1, "ep": 2, "cp": 1, "etp": 1, "xp": 2}
    assert dims.mesh_dims(WITH_XP) == ("pp", "dp", "tp", "xp")
    assert dims.mesh_shape(WITH_XP, degrees) == (1, 2, 2, 2)
    seen = [dims.coords(WITH_XP, degrees, r) for r in range(8)]
    assert [c["xp"] for c in seen] == [0, 1] * 4 and [c["tp"] for c in seen] == [0, 0, 1, 1] * 2
    for r, c in enumerate(seen):
        assert dims.rank_at(WITH_XP, degrees, {k: v for k, v in c.items() if k not in ("ep", "etp")}) == r
    assert "xp" not in dims.coords(WITH_XP, {**degrees, "xp": 1}, 0)  # a newer dimension is named only above 1
    folded = {**degrees, "xf": 4}
    assert [dims.coords((*WITH_XP, XP_FOLDED), folded, r)["xf"] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert LayoutView(degrees={**degrees, "xp": 4}, zero_stage=0, split_backward=False, precision="fp32",
                      model=None).xp == 4


def test_the_store_and_the_export_take_a_new_dimension(store_urls):
    from db import degrees as store
    from db import queries as q
    from db.models import Experiment
    from tests.helpers.store_helpers import spec

    cols = dims.placed_columns(["id", "world_size", "zero_stage", "microbatches"], WITH_XP)
    assert cols[cols.index("cp_load_balance") + 1:][:2] == ["xp", "xp_mode"]
    assert dims.not_applicable(WITH_XP)["xp_mode"] == "xp"
    engine = store_urls.engine()
    old, new = q.submit_experiment(engine, spec("before xp")), q.submit_experiment(engine, spec("with xp"))
    with engine.begin() as c:  # what a run of a ShardLab with xp stores: its field in degrees_json
        held = c.execute(select(Experiment.degrees_json).where(Experiment.id == new)).scalar_one()
        c.execute(update(Experiment).where(Experiment.id == new).values(degrees_json={**held, "xp": 4,
                                                                                      "xp_mode": "tree"}))
    sql = store.columns(WITH_XP)
    with engine.connect() as c:
        rows = c.execute(select(Experiment.id, sql["xp"], sql["xp_mode"], sql["dp"], sql["cp_rotate"])
                         .order_by(sql["xp"].desc(), Experiment.id)).all()
    assert [tuple(r) for r in rows] == [(new, 4, "tree", 2, "allgather"), (old, 1, "ring", 2, "allgather")]


def test_the_recipe_names_the_table_and_files_that_exist():
    """docs/ARCHITECTURE.md's recipe for a parallelism: the table first, every file it names exists."""
    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "ARCHITECTURE.md").read_text()
    recipe = text[text.index("**A parallelism**"):text.index("**A model family feature**")]
    assert "`backend/spec/dims.py`" in recipe.split("\n")[1]
    named = set(re.findall(r"`((?:backend|db|dashboard|tests)/[\w/]+\.py)", recipe))
    assert named and [p for p in sorted(named) if not (root / p).exists()] == []
    assert "`backend/analytic/`" in recipe and "backend/strategies/parallelize.py" in named
