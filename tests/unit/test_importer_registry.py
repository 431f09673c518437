"""Issue 33: one importer registry (backend/importers/registry.py). A throw-away importer "fakefmt" (one module's worth
of code below: a key = value config, a one-line-per-step log) added to the registry is picked up by import-config
(--format choices and help, detection in clue order, its error), import-run (its log parser, the GPU count its log
states, the store's source_framework, the tag, the export) and the Import config box (AppTest: the Format select,
its labels, auto-detection); taken away, it leaves no trace. The real registry keeps the contracts it replaced, and
docs/ARCHITECTURE.md's recipe "A new importer" names the files the registry says a framework takes."""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
from pathlib import Path

import pytest

from backend.cli import build_parser, main
from backend.importers import ConfigImportError, import_config, import_config_text, registry
from backend.importers.entry import Clue, ConfigRequest, Importer, Probe, SourceFormat
from backend.importers.import_result import ImportedConfig
from backend.importers.log_series import Collector

ROOT = Path(__file__).resolve().parents[2]
APP = str(ROOT / "app.py")
FIX = ROOT / "tests" / "fixtures" / "imports"


# ---- the throw-away importer: what a new framework's module holds ---------------------------------------------------

MARK = "# fakefmt config"
STEP = re.compile(r"fake step (\d+) took (\S+) s loss (\S+)")
WORLD = re.compile(r"fake world (\d+)")


def _parse_config(text: str, request: ConfigRequest) -> ImportedConfig:
    from backend.importers.assemble import to_spec
    from backend.importers.fields import Flat, Ignore, To, apply_table, degree, positive_int

    values = dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    flat = Flat({k.strip(): int(v) if v.strip().isdigit() else v.strip() for k, v in values.items()})
    table = {"layers": To("n_layers", positive_int), "width": To("d_model", positive_int),
             "heads": To("n_heads", positive_int), "vocab": To("vocab_size", positive_int),
             "seq": To("seq_len", positive_int), "batch": To("global_batch", positive_int),
             "micro": To("micro_batch", positive_int), "tp": To("tp", positive_int),
             "dp": To("dp", degree), "lr": Ignore("the learning rate changes no memory or step time")}
    apply_table(flat, table)
    return to_spec(flat, framework="fakefmt", source_format="fake-kv", name=f"fake ({request.name})", gpus=request.gpus)


def _parse_log(path: Path, imported: ImportedConfig) -> Collector:
    from backend.importers import log_values as v
    from backend.importers.log_stream import read_lines

    c = Collector("fakefmt", world=imported.gpus)
    for line in read_lines(path, c.stats):
        if m := STEP.search(line.text):
            step = v.integer(m.group(1), "the step", line.number)
            c.add(line.rank, step, v.positive(m.group(2), "took", line.number), line.number, v.loss(m.group(3)))
    c.facts["memory_source"] = "none: the fake log prints no memory"
    return c


def _world(line: str) -> int | None:
    m = WORLD.search(line)
    return int(m.group(1)) if m else None


FAKE = Importer(
    name="fakefmt", label="Fake Framework", reads="a key = value file starting '# fakefmt config'",
    model_config_use="a fake config ignores it",
    formats=(SourceFormat("fake-kv", _parse_config),),
    detect=(Clue(45, "fake-kv", lambda p: MARK in p.text),),  # after torchtitan's log marker, before Megatron's args
    forced=lambda p: "fake-kv", parse_log=_parse_log, log_records="fake step lines (fake step N took S s loss L)",
    rank_order=("dp", "tp"), log_gpus=_world)

CONFIG = f"{MARK}\nlayers = 2\nwidth = 64\nheads = 4\nvocab = 256\nseq = 32\nbatch = 8\nmicro = 2\ndp = 2\nlr = 3\n"
LOG = "fake world 2\n" + "".join(f"fake step {s} took {0.5 + 0.01 * s:.2f} s loss {3 - 0.1 * s:.2f}\n"
                                 for s in range(1, 21))


@pytest.fixture()
def fake(monkeypatch):
    """FAKE registered for the test's body; monkeypatch takes it away again (`monkeypatch.undo()` at will)."""
    monkeypatch.setattr(registry, "IMPORTERS", (*registry.IMPORTERS, FAKE))
    return FAKE


@pytest.fixture()
def files(tmp_path):
    cfg, log = tmp_path / "job.cfg", tmp_path / "train.log"
    cfg.write_text(CONFIG)
    log.write_text(LOG)
    return cfg, log


def _choices(command: str) -> list[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return list(next(a for a in sub.choices[command]._actions if a.dest == "format").choices)


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


# ---- the CLI and import-run -----------------------------------------------------------------------------------------

def test_the_cli_takes_a_new_importer_and_forgets_it(fake, files, monkeypatch, capsys):
    cfg, _ = files
    assert _choices("import-config") == _choices("import-run") == ["torchtitan", "megatron", "deepspeed", "fakefmt"]
    assert "fakefmt: a key = value file starting '# fakefmt config'" in _help("import-config", capsys)
    assert "a fake config ignores it" in _help("import-run", capsys)
    assert main(["import-config", str(cfg), "--json"]) == 0  # detected
    out = json.loads(capsys.readouterr().out)
    assert (out["framework"], out["source_format"], out["gpus"]) == ("fakefmt", "fake-kv", 2)
    assert out["ignored"] == {"lr": {"value": 3, "reason": "the learning rate changes no memory or step time"}}
    assert out["spec"]["model"]["d_model"] == 64 and out["spec"]["parallel"]["dp"] == 2
    plain = cfg.with_name("plain.txt")
    plain.write_text(CONFIG.replace(MARK, "# no mark"))
    assert main(["import-config", str(plain), "--format", "fakefmt", "--json"]) == 0  # what detection cannot tell
    assert json.loads(capsys.readouterr().out)["source_format"] == "fake-kv"
    assert main(["import-config", str(plain)]) == 2
    err = capsys.readouterr().err
    assert "give --format torchtitan|megatron|deepspeed|fakefmt (" in err and err.rstrip().endswith(
        "fakefmt: a key = value file starting '# fakefmt config')")

    monkeypatch.undo()  # taken away: no trace
    assert _choices("import-config") == _choices("import-run") == ["torchtitan", "megatron", "deepspeed"]
    assert "fake" not in _help("import-config", capsys) + _help("import-run", capsys)
    assert main(["import-config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "cannot tell which framework 'job.cfg' is for: give --format torchtitan|megatron|deepspeed (" in err
    assert "fake" not in err
    with pytest.raises(SystemExit) as e:
        main(["import-config", str(cfg), "--format", "fakefmt"])
    assert e.value.code == 2 and "invalid choice: 'fakefmt'" in capsys.readouterr().err
    with pytest.raises(ConfigImportError, match=r"--format 'fakefmt': expected one of torchtitan, megatron, deepspeed"):
        import_config_text(CONFIG, fmt="fakefmt")


def test_detection_tries_every_importers_clues_in_their_order(fake):
    """The fake's clue (order 45) sits between torchtitan's log marker (40) and Megatron's arguments (50)."""
    assert import_config_text(CONFIG + "# --num-layers 2\n", name="x.cfg").framework == "fakefmt"
    with pytest.raises(ConfigImportError, match="not a torchtitan Trainer.Config dump"):
        import_config_text(CONFIG + "# Running with configs: {}\n", name="x.cfg")
    assert import_config_text(CONFIG, name="job.toml", fmt="fakefmt").source_format == "fake-kv"  # --format wins
    assert registry.source_formats()["fakefmt"] == ("fake-kv",)
    with pytest.raises(ConfigImportError, match="a vocabulary size is given for Megatron-LM / NeMo configs, which "
                                                "leave it to the tokenizer; a fakefmt config has its own"):
        import_config_text(CONFIG, vocab_size=100)


def test_import_run_takes_a_new_importer_and_the_store_keeps_its_runs_after(fake, files, monkeypatch, capsys, tmp_path):
    cfg, log = files
    cfg.write_text(CONFIG.replace("dp = 2", "dp = auto"))  # the rest of the GPUs: the count the log states
    url = f"sqlite:///{tmp_path / 'store.db'}"
    assert main(["import-run", "--config", str(cfg), "--log", str(log), "--db", url, "--tag", "lab", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kind"] == "imported" and out["source_framework"] == "fakefmt"
    assert {"imported", "imported:fakefmt", "lab"} <= set(out["tags"])
    facts = out["result"]["imported"]
    assert (facts["framework"], facts["source_format"], facts["gpus"]) == ("fakefmt", "fake-kv", 2)  # gpus: the log's
    assert facts["records_total"] == 20 and facts["warmup_cut_step"] == 1
    assert out["step_s_median"] == pytest.approx(0.61)  # steps 2..20: the median is step 11's
    assert [r["rank"] for r in out["result"]["per_rank"]] == [0]
    assert main(["export", "--db", url, "--format", "csv"]) == 0
    assert [r["source_framework"] for r in csv.DictReader(io.StringIO(capsys.readouterr().out))] == ["fakefmt"]

    monkeypatch.undo()
    assert main(["import-run", "--config", str(cfg), "--log", str(log), "--db", url]) == 2
    assert "nothing stored:\n  cannot tell which framework 'job.cfg' is for" in capsys.readouterr().err
    assert main(["show", str(out["id"]), "--db", url, "--json"]) == 0  # a stored run needs no importer to be read back
    assert json.loads(capsys.readouterr().out)["source_framework"] == "fakefmt"


# ---- the dashboard --------------------------------------------------------------------------------------------------

def _box_run(path: Path, fmt: str | None = None):
    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(APP, default_timeout=60).run()
    assert not at.exception, [e.message for e in at.exception]
    select = at.selectbox(key="ne_imp_fmt")
    options, help_text = list(select.options), at.file_uploader(key="ne_imp_model").help
    at.file_uploader(key="ne_imp_cfg").set_value((path.name, path.read_bytes(), "text/plain"))
    if fmt is not None:
        select.set_value(fmt)
    at.run()
    at.button(key="ne_imp_go").click().run()
    assert not at.exception, [e.message for e in at.exception]
    texts = [str(e.value) for kind in ("error", "caption", "text") for e in at.get(kind)]
    return options, help_text, "\n".join(texts), [e.label for e in at.expander]


@pytest.mark.heavy
def test_the_import_box_takes_a_new_importer_and_forgets_it(fake, files, monkeypatch, tmp_path):
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    cfg, _ = files
    options, help_text, text, expanders = _box_run(cfg)
    assert options == ["auto (from the file)", "torchtitan", "Megatron-LM / NeMo", "DeepSpeed", "Fake Framework"]
    assert "Import config — torchtitan, Megatron-LM / NeMo, DeepSpeed, Fake Framework" in expanders
    assert "a fake config ignores it" in help_text and "Fake Framework: a key = value file" in text
    assert "fakefmt (fake-kv), 2 GPUs = dp 2 x cp 1 x tp 1 x pp 1, ep 1" in text
    plain = cfg.with_name("plain.txt")
    plain.write_text(CONFIG.replace(MARK, "# no mark"))
    assert "fakefmt (fake-kv), 2 GPUs" in _box_run(plain, "Fake Framework")[2]

    monkeypatch.undo()
    monkeypatch.setenv("SHARDLAB_DB_URL", f"sqlite:///{tmp_path / 'ui.db'}")
    monkeypatch.setenv("SHARDLAB_NO_WORKER", "1")
    options, help_text, text, expanders = _box_run(cfg)
    assert options == ["auto (from the file)", "torchtitan", "Megatron-LM / NeMo", "DeepSpeed"]
    assert "Import config — torchtitan, Megatron-LM / NeMo, DeepSpeed" in expanders
    assert "cannot tell which framework 'job.cfg' is for" in text
    page = text + help_text + " ".join(expanders)
    assert "fakefmt" not in page and "Fake Framework" not in page and "a fake config" not in page


# ---- the real registry ----------------------------------------------------------------------------------------------

def test_the_real_registry_keeps_the_contracts():
    assert registry.names() == ("torchtitan", "megatron", "deepspeed")
    assert registry.source_formats() == {
        "torchtitan": ("torchtitan-toml", "torchtitan-config-dump"), "megatron": ("megatron-args", "megatron-log-args",
                                                                               "nemo-yaml"),
        "deepspeed": ("deepspeed-json",)}
    assert [(c.order, i.name, c.source_format) for c, i in registry.clues()] == [
        (10, "torchtitan", "torchtitan-config-dump"), (11, "megatron", "nemo-yaml"),
        (20, "torchtitan", "torchtitan-toml"), (30, "torchtitan", "torchtitan-config-dump"),
        (31, "deepspeed", "deepspeed-json"),
        (40, "torchtitan", "torchtitan-config-dump"), (50, "megatron", "megatron-args"),
        (60, "torchtitan", "torchtitan-toml")]
    assert registry.undetected("x") == (
        "cannot tell which framework 'x' is for: give --format torchtitan|megatron|deepspeed (torchtitan: a job .toml "
        "or the Trainer.Config dump; megatron: pretrain_gpt.py arguments, a launch script, a Megatron log, or a NeMo "
        ".yaml; deepspeed: ds_config.json with --model-config)")
    for importer in registry.IMPORTERS:
        assert {c.source_format for c in importer.detect} <= {f.name for f in importer.formats}
        assert set(importer.rank_order) <= {"pp", "dp", "cp", "tp"}
        importer.source_format(importer.forced(Probe("x", "")))  # a format it has


@pytest.mark.parametrize("path,gpus", [("torchtitan_llama3_8b.toml", 8), ("torchtitan_trainer_config.json", 8),
                                       ("megatron_llama31_8b_cp2.sh", None), ("megatron_llama2_70b.log", None),
                                       ("nemo_gpt_tp2.yaml", None)])
def test_every_format_an_import_reports_is_in_the_registry(path, gpus):
    imported = import_config(FIX / path, gpus=gpus)
    assert imported.source_format in registry.source_formats()[imported.framework]


def test_the_rank_layout_maps_a_frameworks_ranks_as_before():
    """runs.spec_rank with the importer's rank_order gives what the hand-written Megatron / torchtitan formula gave."""
    from types import SimpleNamespace

    from backend.importers.runs import spec_rank

    for pp, dp, cp, tp in [(2, 2, 2, 2), (1, 3, 2, 4), (4, 1, 2, 2), (2, 2, 1, 2)]:
        spec = SimpleNamespace(parallel=SimpleNamespace(pp=pp, dp=dp, tp=tp, world_size=pp * dp * tp))
        for rank in range(pp * dp * cp * tp + 3):  # past the world too
            tp_i, rest = rank % tp, rank // tp
            old = ((rest // (cp * dp)) * dp * tp + ((rest // cp) % dp) * tp + tp_i) % (pp * dp * tp)
            assert spec_rank(registry.by_name("megatron").rank_order, rank, spec, cp) == (old if cp > 1 else
                                                                                          rank % (pp * dp * tp))
            assert spec_rank(registry.by_name("deepspeed").rank_order, rank, spec, cp) == rank % (pp * dp * tp)


# ---- the recipe -----------------------------------------------------------------------------------------------------

def test_the_recipe_names_the_files_the_registry_says_a_framework_takes():
    """docs/ARCHITECTURE.md "A new importer": the registry line, the entry module, the fixtures, and nothing of the
    plumbing that derives from the registry; each real importer is built that way."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    recipe = text[text.index("**A new importer**"):]
    recipe = recipe[:recipe.index("\n\n")]
    named = set(re.findall(r"`((?:backend|db|dashboard|tests)/[\w/<>.*-]+)`", recipe))
    assert {"backend/importers/registry.py", "backend/importers/<name>.py", "tests/fixtures/imports/<name>_*"} <= named
    concrete = {p for p in named if "<" not in p and "*" not in p}
    assert [p for p in sorted(concrete) if not (ROOT / p).exists()] == []
    plumbing = {"backend/importers/__init__.py", "backend/importers/import_result.py", "backend/importers/runs.py",
                "backend/cli/import_config.py", "backend/cli/import_run.py", "dashboard/import_view.py",
                "dashboard/import_box.py", "backend/importers/entry.py"}
    edited = recipe[:recipe.index("Derived from the registry")]
    assert [p for p in sorted(plumbing) if f"`{p}`" in edited] == []
    source = (ROOT / "backend" / "importers" / "registry.py").read_text()
    listed = re.search(r"IMPORTERS: tuple\[Importer, \.\.\.\] = \(([^)]*)\)", source).group(1)
    assert [m.removesuffix(".IMPORTER") for m in re.findall(r"\w+\.IMPORTER", listed)] == list(registry.names())
    for importer in registry.IMPORTERS:
        module = __import__(f"backend.importers.{importer.name}", fromlist=["IMPORTER"])
        assert module.IMPORTER is importer
        fixtures = {p.suffix for p in FIX.glob(f"{importer.name}_*")}
        assert ".log" in fixtures and fixtures - {".log"}, f"{importer.name}: a config and a log fixture"
