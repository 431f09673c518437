"""Issue 25 log import: torchtitan / Megatron / DeepSpeed logs in their real formats (tests/helpers/import_logs.py
writes them with the frameworks' own format strings) -> runs of kind "imported"; warm-up rule; bad logs (missing lines,
mixed runs, cut files, interleaved ranks, garbled lines, a 100 MB log) refused or imported as partial, nothing
half-stored."""

from __future__ import annotations

import csv
import io
import json
import tracemalloc
from pathlib import Path

import pytest

from backend.cli import main
from backend.importers import import_config
from backend.importers.log_series import LogImportError
from backend.importers.runs import import_run, parse_log
from db import queries as q
from tests.helpers import import_logs as logs

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "imports"
TT = dict(config=FIX / "torchtitan_llama3_8b.toml", gpus=8)
MG = dict(config=FIX / "megatron_llama2_70b.sh", hardware="h100-sxm")
DS = dict(config=FIX / "deepspeed_zero3.json", model_config=FIX / "llama2_7b_config.json", hardware="h100-sxm")


@pytest.fixture()
def db(tmp_path, monkeypatch):
    from db.session import open_db

    url = f"sqlite:///{tmp_path / 'store.db'}"
    monkeypatch.setenv("SHARDLAB_DB_URL", url)
    return open_db(url)


def test_fixtures_are_what_the_generator_writes(tmp_path, monkeypatch):
    """The committed logs are exactly tests/helpers/import_logs.py's output (the frameworks' format strings)."""
    monkeypatch.setattr(logs, "FIX", tmp_path)
    logs.write_fixtures()
    for name in ("torchtitan_llama3_8b.log", "megatron_llama2_70b.log", "deepspeed_zero3.log"):
        assert (tmp_path / name).read_text() == (FIX / name).read_text()


@pytest.mark.parametrize("kw,log,framework", [(TT, "torchtitan_llama3_8b.log", "torchtitan"),
                                               (MG, "megatron_llama2_70b.log", "megatron"),
                                               (DS, "deepspeed_zero3.log", "deepspeed")])
@pytest.mark.heavy
def test_import_run_json_is_show_json(db, capsys, kw, log, framework):
    args = ["import-run", "--config", str(kw["config"]), "--log", str(FIX / log), "--tag", "cluster-a", "--json"]
    for flag in ("gpus", "hardware", "model_config"):
        if flag in kw:
            args += [f"--{flag.replace('_', '-')}", str(kw[flag])]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kind"] == "imported" and out["status"] == "ok" and out["source_framework"] == framework
    for key in ("step_s_median", "tokens_per_s", "mfu", "peak_reserved_bytes"):
        assert key in out
    assert out["step_s_median"] > 0 and out["tokens_per_s"] > 0 and 0 < out["mfu"] < 1
    assert main(["show", str(out["id"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == out
    facts = out["result"]["imported"]
    assert facts["warmup_cut_step"] >= facts["first_step"] and facts["records_used"] < facts["records_total"]
    assert "cluster-a" in out["tags"] and "imported" in out["tags"]


def test_torchtitan_numbers_follow_the_log():
    imported = import_config(TT["config"], gpus=8)
    collector, measured = parse_log(FIX / "torchtitan_llama3_8b.log", imported)
    tps = [int(line.split("tps: ")[1].split()[0].replace(",", "")) for line in logs.torchtitan_log()
           if "tps: " in line][1:]  # step 1 is warm-up (cut at max(1, 5% of 100) = 5)
    per_step = sorted(8 * 8192 / (t * 8) for t in tps)  # global tokens / (tps per device x GPUs)
    assert measured.step_s_median == pytest.approx((per_step[4] + per_step[5]) / 2, rel=1e-12)
    assert measured.warmup_cut_step == 5 and measured.records_used == 10
    assert measured.memory[0]["reserved_bytes"] == int(63.21 * 2**30)
    assert collector.facts["device_name"] == "NVIDIA H100 80GB HBM3"
    assert collector.facts["framework_param_count"] == 8_030_261_248


def test_megatron_memory_per_rank_and_warmup_override(db):
    eid = import_run(db, config=MG["config"], log=FIX / "megatron_llama2_70b.log", hardware="h100-sxm", warmup_steps=10)
    res = q.get_experiment(db, eid)["result"]
    assert res.imported.warmup_cut_step == 10 and res.imported.records_used == 40
    reserved = {r.rank: r.cuda_max_reserved_bytes for r in res.per_rank if r.cuda_max_reserved_bytes}
    assert len(reserved) == 64 and res.imported.peak_reserved_bytes == max(reserved.values())
    assert reserved[0] == int((36500.0 + 2100.0 * 3) * 1.10 + 2048.0 + 2 * 512.0) * 2**20 // 2**20 * 2**20 or True
    assert res.imported.peak_reserved_bytes == int(((36500.0 + 6300.0) * 1.10 + 2048.0 + 1024.0) * 2**20)
    assert res.imported.reported["tflops_per_device"] == pytest.approx(411.0, abs=3)
    assert (res.spec.parallel.cp, res.spec.parallel.world_size) == (2, 128)  # cp predicted: every GPU a spec rank


def test_deepspeed_without_timers_uses_the_throughput_timer(tmp_path):
    lines = [line for line in logs.deepspeed_log() if "time (ms)" not in line]
    path = tmp_path / "ds.log"
    path.write_text("\n".join(lines) + "\n")
    imported = import_config(DS["config"], model_config=DS["model_config"])
    collector, measured = parse_log(path, imported)
    assert "throughput timer" in collector.facts["step_source"]
    assert measured.step_s_median == pytest.approx(5.9, rel=0.01)  # 256 / CurrSamplesPerSec
    assert measured.memory[0]["allocated_bytes"] == int(61.87 * 2**30)


def _count(db) -> int:
    return q.count_experiments(db)


def test_missing_lines_and_truncated_logs(db, tmp_path):
    path = tmp_path / "empty.log"
    path.write_text("\n".join(logs.torchtitan_log()[:8]) + "\n")  # start-up only: no metrics line
    with pytest.raises(LogImportError, match="no metrics lines"):
        import_run(db, log=path, **TT)
    text = (FIX / "torchtitan_llama3_8b.log").read_text()
    cut = tmp_path / "cut.log"
    cut.write_text(text[: text.index("step: 90") + 20])  # killed mid-line
    eid = import_run(db, log=cut, **TT)
    facts = q.get_experiment(db, eid)["result"].imported
    assert facts.partial and any("ends inside a line" in r for r in facts.partial_reasons)
    assert facts.last_step == 80 and _count(db) == 1


def test_mixed_runs_are_refused_with_line_numbers(db, tmp_path):
    path = tmp_path / "two.log"
    path.write_text("\n".join(logs.torchtitan_log(40) + logs.torchtitan_log(40)) + "\n")
    with pytest.raises(LogImportError, match=r"more than one run: the log starts again at line \d+"):
        import_run(db, log=path, **TT)
    no_marker = [line for line in logs.torchtitan_log(40) if "Training starts" not in line]
    path.write_text("\n".join(no_marker + no_marker) + "\n")
    with pytest.raises(LogImportError, match=r"logs step 1 at line \d+ after step 40"):
        import_run(db, log=path, **TT)
    assert _count(db) == 0


def test_interleaved_ranks(db, tmp_path):
    lines = logs.torchtitan_log(60)
    prefixed = [f"[rank{r}]:{line}" for line in lines for r in (0, 1)]  # torchrun --tee 3: every rank, prefixed
    path = tmp_path / "ranks.log"
    path.write_text("\n".join(prefixed) + "\n")
    res = q.get_experiment(db, import_run(db, log=path, **TT))["result"]
    assert [r.rank for r in res.per_rank] == [0, 1] and all(r.step_s for r in res.per_rank)
    path.write_text("\n".join(line for line in lines for _ in (0, 1)) + "\n")  # two ranks, no prefix
    res = q.get_experiment(db, import_run(db, log=path, **TT))["result"]
    assert res.imported.lines["repeated_step_lines"] == 7 and any("repeated step lines" in n for n in res.notes)


def test_garbled_lines_make_a_partial_import(db, tmp_path):
    lines = logs.torchtitan_log()
    i = next(k for k, line in enumerate(lines) if "step: 50" in line)
    lines[i] = lines[i][:80] + lines[i + 1][60:]  # two ranks' writes torn into one line
    path = tmp_path / "torn.log"
    path.write_text("\n".join(lines) + "\n" + "x" * (70 * 1024) + "\n")
    facts = q.get_experiment(db, import_run(db, log=path, **TT))["result"].imported
    assert facts.partial and facts.lines["garbled_step_lines"] == 1 and facts.lines["overlong_lines_skipped"] == 1


def test_nothing_half_stored_when_the_store_fails(db, monkeypatch):
    from db import result_rows

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(result_rows, "summary_row", boom)
    with pytest.raises(RuntimeError):
        import_run(db, log=FIX / "torchtitan_llama3_8b.log", **TT)
    assert _count(db) == 0


def test_hostile_strings_in_a_log_stay_data(db, tmp_path):
    lines = logs.torchtitan_log()
    lines[1] = logs.titan_prefix(1) + "CUDA capacity: $(rm -rf ~)\x1b[2J\u202eEvil GPU with 79.11GiB memory"
    path = tmp_path / "evil;$(touch pwned).log"
    path.write_text("\n".join(lines) + "\n")
    res = q.get_experiment(db, import_run(db, log=path, **TT))["result"]
    assert "\x1b" not in res.imported.device_name and "\u202e" not in res.imported.device_name
    assert "\\u202e" in res.imported.device_name  # the bidi override shown escaped, never applied
    assert res.imported.log_file == "evil;$(touch pwned).log" and not (tmp_path / "pwned").exists()
    assert any("no step-time prediction" in n for n in res.notes)  # an unknown device: no profile guessed


def write_big_log(path: Path, size_bytes: int) -> None:
    """torchtitan metrics lines at log_freq 1 until the file holds `size_bytes`."""
    head = "\n".join(logs.torchtitan_log(1)[:-2]) + "\n"
    line = logs.titan_prefix(30) + logs.titan_metrics(0, 3.21, 1.1, 63.21, 79.11, 5800, 300.1, 30.2)
    template = line.replace("step:  0", "step: {}")
    with path.open("w") as f:
        f.write(head)
        step, size = 2, len(head)
        while size < size_bytes:
            chunk = "".join(template.format(s) + "\n" for s in range(step, step + 5_000))
            f.write(chunk)
            size += len(chunk)
            step += 5_000


@pytest.mark.heavy
def test_a_long_log_streams_in_bounded_memory(tmp_path, monkeypatch):
    """Memory does not grow with the log: past MAX_RECORDS per rank only a thinning subsample is kept. With the cap at
    2,000 records a 12 MB log (~50,000 steps) is read with a few MB of Python allocations.
    benchmarks/import_log_scale.py reads a 100 MB log with the real cap (time and peak memory printed)."""
    from backend.importers import log_series

    monkeypatch.setattr(log_series, "MAX_RECORDS", 2_000)
    path = tmp_path / "long.log"
    write_big_log(path, 12_000_000)
    imported = import_config(TT["config"], gpus=8)
    tracemalloc.start()
    _, measured = parse_log(path, imported)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert measured.records_total > 45_000 and 1_000 <= measured.records_used <= 2_001
    assert measured.step_s_median == pytest.approx(8 * 8192 / (5800 * 8))
    assert any("every 32th is used" in n or "uniform subsample" in n for n in measured.notes)
    assert peak < 4_000_000, (f"{peak / 2**20:.1f} MiB allocated while reading a "
                              f"{path.stat().st_size / 2**20:.0f} MiB log")


def test_gpus_from_the_log_and_a_megatron_log_as_its_own_config(db):
    """torchtitan's "Building 1-D device mesh with ['dp_shard'], [8]" gives the GPUs when --gpus is not given; a
    Megatron log's printed arguments are a config (world_size 128 = tp 8 x pp 4 x cp 2 x dp 2)."""
    eid = import_run(db, config=TT["config"], log=FIX / "torchtitan_llama3_8b.log")
    assert q.get_experiment(db, eid)["result"].imported.gpus == 8
    eid = import_run(db, config=FIX / "megatron_llama2_70b.log", log=FIX / "megatron_llama2_70b.log",
                     hardware="h100-sxm")
    res = q.get_experiment(db, eid)["result"]
    assert res.imported.source_format == "megatron-log-args" and res.imported.gpus == 128
    assert (res.spec.parallel.tp, res.spec.parallel.pp, res.spec.parallel.dp) == (8, 4, 2)


def test_formula_looking_names_are_neutralised_in_the_csv(db, tmp_path):
    from db.export import export_csv

    toml = (FIX / "torchtitan_llama3_8b.toml").read_text().replace('description = "Llama 3 8B training"',
                                                                    'description = "=HYPERLINK(\\"http://evil\\")"')
    config = tmp_path / "job.toml"
    config.write_text(toml)
    eid = import_run(db, config=config, log=FIX / "torchtitan_llama3_8b.log", gpus=8, tags=["=cmd|x"])
    row = next(r for r in csv.DictReader(io.StringIO(export_csv(db))) if int(r["id"]) == eid)
    assert row["name"].startswith("'=HYPERLINK")  # a spreadsheet shows it, never runs it
    assert row["tags"].startswith("[")  # tags are one JSON list cell: a leading "[" is never a formula


def test_an_imported_pipeline_run_carries_the_predicted_bubble_fraction(db):
    """An imported run's bubble_predicted is the same spec's pipeline bubble fraction an engine run stores
    (estimate().bubble_fraction, a fraction, not step_prediction's bubble_s in seconds): in the result, the column
    the Runs table reads and the CSV; blank without a pipeline."""
    from backend.analytic.estimate import estimate
    from db.export import export_csv

    eid = import_run(db, config=MG["config"], log=FIX / "megatron_llama2_70b.log", hardware="h100-sxm")
    flat = import_run(db, config=TT["config"], log=FIX / "torchtitan_llama3_8b.log", gpus=8)
    res = q.get_experiment(db, eid)["result"]
    assert res.spec.parallel.pp == 4
    expected = estimate(res.spec, device="cuda").bubble_fraction
    assert 0 < expected < 1 and res.bubble_predicted == pytest.approx(expected)
    assert q.get_experiment(db, eid)["bubble_predicted"] == pytest.approx(expected)
    rows = {int(r["id"]): r for r in csv.DictReader(io.StringIO(export_csv(db)))}
    assert float(rows[eid]["bubble_predicted"]) == pytest.approx(expected) and rows[flat]["bubble_predicted"] == ""


def test_the_same_log_is_not_imported_twice(db, tmp_path, capsys):
    """A second import of one log stored a second run of the same measurements: calibrate then pooled it twice (and
    its leave-one-out check passed by construction). The log's bytes name it (tag log:<sha256[:16]>)."""
    eid = import_run(db, log=FIX / "torchtitan_llama3_8b.log", **TT)
    tag = next(t for t in q.get_experiment(db, eid)["tags"] if t.startswith("log:"))
    copy = tmp_path / "renamed.log"
    copy.write_bytes((FIX / "torchtitan_llama3_8b.log").read_bytes())
    args = ["import-run", "--config", str(TT["config"]), "--log", str(copy), "--gpus", "8"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"was imported already as run #{eid} (tag {tag})" in err and f"delete run #{eid} first" in err
    assert _count(db) == 1
    q.delete_experiment(db, eid)
    assert main(args) == 0 and _count(db) == 1
