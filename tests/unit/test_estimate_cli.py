"""`python -m backend estimate`: table, --json contract, ZeRO paper numbers, inference mode, errors; the CLI in-process
(`backend.cli.main`), and once as the program itself (the entry point: `python -m backend` in a process)."""

from __future__ import annotations

import json

import pytest

from backend.cli import main
from tests.helpers.launch import cli, cli_process


@pytest.mark.parametrize("stage,gb", [(0, "120.0"), (1, "31.4"), (2, "16.6"), (3, "1.9")])
def test_zero_paper_table(stage, gb, capsys):
    assert main(["estimate", "--params", "7.5e9", "--dp", "64", "--zero-stage", str(stage), "--precision",
                 "fp16-mixed"]) == 0
    out = capsys.readouterr().out
    marked = [line for line in out.splitlines() if line.startswith("*")]
    assert marked == [line for line in out.splitlines() if f"ZeRO stage {stage}:" in line and line.startswith("*")]
    assert f"total {gb} GB per device" in marked[0]


def test_zero_paper_json(capsys):
    assert main(["estimate", "--params", "7.5e9", "--dp", "64", "--zero-stage", "1", "--precision", "fp16-mixed",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert round(d["total_bytes"] / 1e9, 1) == 31.4 and d["k"] == 12


def test_table_lists_every_rank(capsys):
    assert main(["estimate", "--strategy", "pp", "--world", "2", "--layers", "4", "--global-batch", "4",
                 "--micro-batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "optimizer" in out and "bubble 0.2" in out and "send" in out
    assert len([line for line in out.splitlines() if line.strip().startswith(("0 ", "1 "))]) == 2


def test_spec_file_and_flag_override(tmp_path, capsys):
    f = tmp_path / "s.json"
    f.write_text(json.dumps({"model": {"n_layers": 2}, "parallel": {"strategy": "ddp", "world_size": 2}}))
    assert main(["estimate", "--spec", str(f), "--world", "4", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["per_rank"]) == 4


def test_world_defaults_to_product_of_degrees(capsys):
    assert main(["estimate", "--tp", "2", "--pp", "2", "--strategy", "zero2", "--dp", "2", "--layers", "4",
                 "--global-batch", "8", "--micro-batch", "1", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["per_rank"]) == 8


def test_inference_mode(capsys):
    assert main(["estimate", "--mode", "inference", "--batch", "4", "--context", "128", "--tp", "2", "--strategy", "tp",
                 "--precision", "bf16-mixed", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    h, heads, layers = 128, 4, 2  # spec defaults
    assert d["kv_cache_bytes"] == 2 * 4 * 128 * layers * (heads // 2) * (h // heads) * 2
    assert all("weights_bytes" in r for r in d["per_rank"])


def test_invalid_spec_via_main(capsys):
    assert main(["estimate", "--heads", "8", "--tp", "3", "--world", "3", "--hidden", "96", "--ffn", "384"]) == 2
    assert "tp=3 does not divide n_heads=8" in capsys.readouterr().err


@pytest.mark.parametrize("args,needle", [
    (["--params", "-5"], "--params must be a positive"),
    (["--params", "nan"], "--params must be a positive"),
    (["--params", "1e9", "--mode", "inference"], "training model states only"),
    (["--params", "1e9", "--strategy", "tp"], "--params needs a data-parallel strategy"),
    (["--batch", "2"], "--batch/--context apply to --mode inference"),
    (["--mode", "inference", "--batch", "0"], "--batch and --context must be >= 1"),
])
def test_bad_flag_values(args, needle, capsys):
    assert main(["estimate", *args]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("args,needle", [
    (["--dp", "0"], "--dp must be >= 1 (got 0)"),
    (["--world", "0"], "--world must be >= 1 (got 0)"),
    (["--dp", "-4"], "--dp must be >= 1 (got -4)"),
    (["--dp", "8", "--world", "16", "--zero-stage", "3"], "--dp 8 contradicts --world 16"),
    (["--dp", "8", "--tp", "2"], "it does not read --tp: drop it"),
    (["--dp", "8", "--pp", "2", "--layers", "4", "--async-tp", "--no-tie-embeddings", "--rank-limit", "3"],
     "it does not read --layers, --pp, --tie-embeddings, --tp-comm-overlap/--async-tp, --rank-limit: drop them"),
])
def test_params_mode_refuses_what_it_would_ignore(args, needle, capsys):
    """--dp 0 read as "not given" (N=1), and --world beside --dp, --tp, --pp, ... were silently ignored."""
    assert main(["estimate", "--params", "7e9", *args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and needle in err and "Traceback" not in err


def test_params_mode_reads_world_as_n(capsys):
    assert main(["estimate", "--params", "7e9", "--world", "8", "--zero-stage", "3", "--json"]) == 0
    by_world = json.loads(capsys.readouterr().out)
    assert main(["estimate", "--params", "7e9", "--dp", "8", "--world", "8", "--zero-stage", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == by_world and by_world["n"] == 8


def test_unreadable_spec_file(tmp_path, capsys):
    assert main(["estimate", "--spec", str(tmp_path / "missing.json")]) == 2
    assert "cannot read --spec" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_json_contract_subprocess():
    """The entry point itself: `python -m backend estimate --json` as a program prints exactly one JSON object."""
    p = cli_process("estimate", "--strategy", "zero3", "--world", "4", "--layers", "2", "--global-batch", "8",
                    "--micro-batch", "1", "--json", timeout_s=120)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)  # exactly one JSON object on stdout
    assert [r["rank"] for r in d["per_rank"]] == [0, 1, 2, 3]
    for row in d["per_rank"]:
        assert {"params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "total_bytes"} <= set(row)
    assert set(d["comm_bytes_per_step"]) == {"all_gather", "reduce_scatter"}
    assert d["bubble_fraction"] is None and d["flops_per_step"] > 0


def test_invalid_spec_exits_2_with_arithmetic():
    p = cli("estimate", "--dp", "2", "--tp", "3", "--world", "4")
    assert p.code == 2 and p.out == ""
    assert "dp(2) * tp(3) * pp(1) = 6 != world_size(4)" in p.err


def test_unknown_choice_is_usage_error():
    p = cli("estimate", "--strategy", "zero9")
    assert p.code == 2 and "invalid choice" in p.err


def test_json_gives_each_rank_and_rank_class_its_fullest_moment(capsys):
    """Issue 32: `estimate --json` carries each rank's fullest moment and which one it is, so no caller recomputes it:
    `fullest_bytes` = the largest of the moments (activation peak, optimizer.step, the start of the loss's backward,
    inside backward), `fullest_moment` its name; the per-class summary of a paged world carries them too. zero3 with
    full recompute peaks inside backward (the re-run block, the gathered parameters, the reduce-scatter input)."""
    args = ["--strategy", "zero3", "--world", "4", "--layers", "4", "--hidden", "256", "--heads", "4", "--seq", "256",
            "--global-batch", "4", "--micro-batch", "1", "--recompute", "full"]
    assert main(["estimate", *args, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    for row in d["per_rank"]:
        moments = {"activation_peak": row["total_bytes"],
                   "optimizer_step": row["total_bytes"] - row["activations_bytes"] + row["optimizer_temp_bytes"],
                   "loss_backward": row["loss_backward_bytes"], "backward": row["backward_bytes"]}
        assert row["fullest_bytes"] == max(moments.values()) and moments[row["fullest_moment"]] == row["fullest_bytes"]
        assert row["fullest_moment"] == "backward" and row["backward_bytes"] > row["total_bytes"]
    assert main(["estimate", *args, "--json", "--rank-limit", "2"]) == 0
    paged = json.loads(capsys.readouterr().out)
    assert all({"fullest_bytes", "fullest_moment"} <= c.keys() for c in paged["rank_classes"])


def test_a_failed_step_time_check_is_named_not_a_traceback(monkeypatch, capsys):
    """The step-time model's own sum check (InconsistentStepTime) reaches `estimate --hardware` as a named failure with
    exit 2, as `plan` reports it, never a traceback."""
    import backend.analytic.steptime.model as model

    def broken(*_a, **_k):
        raise model.InconsistentStepTime("compute 1.0 + exposed comm 0.5 != step 2.0")

    monkeypatch.setattr(model, "step_time", broken)
    rc = main(["estimate", "--layers", "2", "--hidden", "64", "--heads", "4", "--world", "2", "--strategy", "ddp",
               "--hardware", "h100-sxm"])
    err = capsys.readouterr().err
    assert rc == 2 and "failed its own check" in err and "compute 1.0 + exposed comm 0.5 != step 2.0" in err
    assert "Traceback" not in err


def test_with_a_gpu_profile_the_per_rank_table_is_the_gpus_the_fit_reads(capsys):
    """`--hardware h100-sxm` fits CUDA ranks; the per-rank table beside it was this host's CPU ranks (here, without
    flash attention: 418 GB against a fit of 104 GB for the torchtitan 8B spec). Both are the CUDA estimate now."""
    args = ["estimate", "--preset", "llama-3-8b", "--world", "8", "--strategy", "fsdp", "--global-batch", "16",
            "--precision", "fp8", "--stack", "torchtitan", "--json"]
    assert main(args) == 0
    host = json.loads(capsys.readouterr().out)
    assert host["memory_device"] == "cpu"
    assert main([*args, "--hardware", "h100-sxm"]) == 0
    gpu = json.loads(capsys.readouterr().out)
    assert gpu["memory_device"] == "cuda"
    rank = gpu["per_rank"][gpu["fit"]["rank"]]
    assert rank["fullest_bytes"] == gpu["fit"]["fullest_bytes"] < host["per_rank"][0]["fullest_bytes"]
    assert main([*args[:-1], "--hardware", "h100-sxm"]) == 0
    assert "memory per rank on CUDA ranks" in capsys.readouterr().out



@pytest.mark.parametrize("args,needle", [
    (["--tp", "2", "--async-tp", "--no-tp-comm-overlap"], "--no-tp-comm-overlap: contradicts --async-tp"),
    (["--tp", "2", "--no-tp-comm-overlap", "--async-tp"], "--async-tp: contradicts --no-tp-comm-overlap"),
    (["--nnodes", "2", "--nodes", "1"], "--nodes: contradicts --nnodes"),
    (["--zero-stage", "1", "--strategy", "zero3"],
     "--zero-stage 1 means --strategy zero1; --strategy zero3 contradicts"),
    (["--params", "7e9", "--dp", "8", "--zero-stage", "1", "--strategy", "zero3"],
     "--zero-stage 1 means --strategy zero1; --strategy zero3 contradicts"),
])
def test_two_flags_for_one_field_must_agree(args, needle):
    """Aliases (--async-tp / --tp-comm-overlap, --nodes / --nnodes) and --zero-stage beside --strategy silently kept
    one of two contradicting values (the last alias; --strategy in a spec, --zero-stage with --params)."""
    p = cli("estimate", *args, "--json")
    assert p.code == 2 and p.out == "" and needle in p.err and "Traceback" not in p.err


@pytest.mark.parametrize("args", [["--tp", "2", "--sequence-parallel", "--async-tp", "--tp-comm-overlap"],
                                  ["--nnodes", "1", "--nodes", "1"], ["--zero-stage", "3", "--strategy", "fsdp"],
                                  ["--tp", "2", "--tp-comm-overlap", "--no-tp-comm-overlap"]])
def test_agreeing_or_repeated_flags_still_run(args, capsys):
    assert main(["estimate", "--world", "2", *args, "--json"]) == 0
