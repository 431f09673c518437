"""Issue 21 items 8-10: one validation of user text and uploads for both stores, every sweep value validated like
a single run, and clear errors (exit 2) instead of tracebacks for hostile files (a wrong config.json, an odd spec
file); `list` never prints raw control characters. Each store case runs on SQLite and on a real PostgreSQL server
(store_urls)."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import update

from backend.cli import main
from backend.hf.config import HFConfigError, from_hf_config
from backend.spec import validate_spec
from backend.spec.user_text import MAX_SOURCE_BYTES, MAX_TAG_CHARS
from db import queries as q
from db.models import Experiment
from db.session import REPO, open_db
from tests.helpers.launch import cli
from tests.helpers.store_helpers import TINY

FLAGS = ["--world", "2", "--hidden", "32", "--layers", "2", "--heads", "2", "--seq", "16", "--vocab", "64",
         "--global-batch", "4", "--micro-batch", "2", "--steps", "2"]
LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
         "intermediate_size": 64, "max_position_embeddings": 16, "hidden_act": "silu"}


@pytest.fixture
def db(store_urls):
    return store_urls.url("hostile.db")


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", ["nul\x00byte", "esc\x1b[2Jclear", "two\nlines", "bidi\u202eevil", "x" * 201])
def test_names_with_control_characters_or_too_long_are_refused_on_both_stores(capsys, db, name):
    code, out, err = run(capsys, "submit", "--db", db, *FLAGS, "--name", name)
    assert code == 2 and out == "" and "name" in err and "Traceback" not in err
    assert len(err) < 600  # a 120 KB name does not come back as a 120 KB error
    assert q.count_experiments(open_db(db)) == 0


def test_tags_have_one_limit_on_both_stores(capsys, db):
    long_tag = "t" * (MAX_TAG_CHARS + 1)
    for bad in (long_tag, "a\x00b", "x" * 120_000, "line\nbreak"):
        code, out, err = run(capsys, "submit", "--db", db, *FLAGS, "--tag", bad)
        assert code == 2 and out == "" and "tag 1" in err and "Traceback" not in err, err[:300]
    code, out, _ = run(capsys, "submit", "--db", db, *FLAGS, "--tag", "t" * MAX_TAG_CHARS, "--tag", "ünï 🚀")
    assert code == 0
    eid = int(out)
    assert sorted(q.get_experiment(open_db(db), eid)["tags"]) == sorted(["t" * MAX_TAG_CHARS, "ünï 🚀"])
    code, _, err = run(capsys, "tag", str(eid), "fine", "a\x1bb", "--db", db)
    assert code == 2 and "control character U+001B" in err
    assert sorted(q.get_experiment(open_db(db), eid)["tags"]) == sorted(["t" * MAX_TAG_CHARS, "ünï 🚀"])


@pytest.mark.heavy
def test_an_uploaded_config_is_stored_as_its_parsed_fields_within_a_cap(capsys, db, tmp_path):
    bulky = {**LLAMA, "id2label": {str(i): f"label {i}" for i in range(200_000)}}  # ~5 MB of metadata
    model, _ = from_hf_config(bulky, file="config.json")
    assert "id2label" not in model["source"]["hf_config"] and model["source"]["hf_config"]["hidden_size"] == 32
    spec, problems = validate_spec({**TINY, "model": {**model}})
    assert problems == [] and len(spec.model_dump_json()) < 4096
    huge = tmp_path / "config.json"
    with open(huge, "w") as f:  # a 100 MB config.json is refused before it is read whole
        f.write('{"model_type": "llama", "id2label": {')
        f.write(", ".join(f'"{i}": "{"x" * 90}"' for i in range(1_050_000)))
        f.write("}}")
    code, out, err = run(capsys, "submit", "--db", db, *FLAGS, "--hf-config", str(huge))
    assert code == 2 and "over the 1,048,576-byte limit" in err
    source = {"hf_config": {**LLAMA, "rope_scaling": {"factor": "y" * MAX_SOURCE_BYTES}}}
    spec, problems = validate_spec({**TINY, "model": {**TINY["model"], "source": source}})
    assert spec is None and "over the 32,768-byte limit" in problems[0]


@pytest.mark.parametrize("value", [-1, -4, 2.7, True, 5, "x", None])
def test_every_sweep_value_is_validated_like_a_single_run(capsys, db, tmp_path, value):
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"zero_stage": [value]}))
    code, out, err = run(capsys, "submit", "--db", db, *FLAGS, "--sweep", str(grid))
    assert code == 2 and out == "" and "must be one of the integers 0, 1, 2, 3" in err and "Traceback" not in err
    assert q.count_experiments(open_db(db)) == 0


def test_boolean_and_nested_sweep_values_are_refused_by_the_spec_checks(capsys, db, tmp_path):
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"world": [True, 2], "zero_stage": [1]}))
    code, out, err = run(capsys, "submit", "--db", db, *FLAGS, "--sweep", str(grid))
    assert code == 0 and len(out.split()) == 1 and "True is a boolean, not a number" in err
    (row,) = q.list_experiments(open_db(db))
    assert (row["world_size"], row["strategy"], row["name"]) == (2, "zero1", "world=2 zero_stage=1")
    grid.write_text("[" * 100_000 + "]" * 100_000)
    code, _, err = run(capsys, "submit", "--db", db, *FLAGS, "--sweep", str(grid))
    assert code == 2 and "nests too deep" in err


def test_list_and_show_escape_control_characters_stored_before_the_rules(capsys, db):
    """Rows written by an older version (or straight into the database) may hold anything: output escapes it."""
    code, out, _ = run(capsys, "submit", "--db", db, *FLAGS, "--name", "placeholder", "--tag", "t")
    eid = int(out)
    engine = open_db(db)
    fake_row = "evil\n    99 ok          ddp          2 2×1×1×1                  0.0001    999999  faked"
    with engine.begin() as c:
        c.execute(update(Experiment).where(Experiment.id == eid).values(name=f"\x1b[2J\x1b[H{fake_row}\u202e"))
    code, out, _ = run(capsys, "list", "--db", db)
    assert code == 0 and "\x1b" not in out and "\u202e" not in out
    lines = out.splitlines()
    assert len(lines) == 2 and "\\x1b[2J\\x1b[Hevil\\x0a    99 ok" in lines[1] and lines[1].endswith("faked\\u202e [t]")
    code, out, _ = run(capsys, "show", str(eid), "--db", db)
    assert code == 0 and "\x1b" not in out and "\\x1b[2J" in out


def test_run_detail_puts_user_text_in_plain_text_elements_only(tmp_path, monkeypatch):
    """The fast twin of tests/e2e/test_browser_hostile_text.py: no markdown element carries a name, tag or error."""
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from tests.helpers.store_helpers import fake_result, spec

    url = f"sqlite:///{tmp_path / 'ui.db'}"
    monkeypatch.setenv("SHARDLAB_DB_URL", url)
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    st.cache_data.clear()
    s = spec("![n](http://evil.example/n.png) [x](http://evil.example/x)")
    engine = open_db(url)
    eid = q.submit_experiment(engine, s, tags=["![t](http://evil.example/t.png)"])
    q.claim_next(engine, "w")
    result = fake_result(s, "failed")
    result.error, result.notes = "see ![e](http://evil.example/e.png)", ["[note](http://evil.example/note)"]
    q.store_result(engine, eid, result)
    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=60).run()
    at.query_params["run"] = str(eid)
    at.switch_page("dashboard/pages/run_detail.py").run()
    assert not at.exception, [e.message for e in at.exception]
    rendered = [str(e.value) for kind in ("markdown", "caption", "error", "info", "warning", "success")
                for e in at.get(kind)]
    assert not [m for m in rendered if "evil.example" in m], rendered
    plain = "\n".join(str(e.value) for e in at.get("text"))
    for shown in (s.name, "![t](http://evil.example/t.png)", "see ![e](", "[note](http://evil.example/note)"):
        assert shown in plain, shown


def test_wrong_typed_or_incomplete_config_json_is_an_error_not_a_traceback(tmp_path):
    for bad, said in ((dict(LLAMA, hidden_size="big"), "hidden_size='big' must be an integer >= 1"),
                      (dict(LLAMA, num_attention_heads=[2]), "num_attention_heads=[2]"),
                      ({k: v for k, v in LLAMA.items() if k != "vocab_size"}, "config.json lacks vocab_size"),
                      (dict(LLAMA, tie_word_embeddings="yes"), "must be true or false")):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(bad))
        done = cli("estimate", "--hf-config", str(path), "--world", "2")
        assert done.code == 2 and said in done.err and "Traceback" not in done.err, done.err[-500:]
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
        done = cli("estimate", "--spec", str(path), "--world", "2")
        assert done.code == 2 and said in done.err and "Traceback" not in done.err, (name, done.err[-500:])
