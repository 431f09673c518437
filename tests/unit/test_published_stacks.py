"""Issue 34 item 4: published evidence per stack. Each recipe row of the research notes (Sec 7: NeMo 24.07 and
Megatron-Bridge performance summaries, Megatron-LM's H100 weak scaling, torchtitan's benchmark files) is its quoted
configuration with the stack settings its source states, predicted through its spec alone (what `estimate` prints)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from backend.analytic.steptime.hardware import get_hardware
from backend.analytic.steptime.model import step_time
from backend.analytic.steptime.published_gpu import published_rows, raw_rows
from backend.importers.megatron_args import import_args
from backend.spec import ExperimentSpec
from backend.spec.stacks import STACK_CHOICES

NEMO = [r for r in raw_rows() if r["id"].startswith("nemo2407-")]
TITAN = [r for r in raw_rows() if r["id"].startswith("titan-")]
MTNLG = [r for r in raw_rows() if r["id"].startswith("mtnlg-530b-")]


def _cells(quote: str) -> list[str]:
    return [c.strip() for c in quote.strip().strip("|").split("|")]


@pytest.mark.parametrize("row", NEMO, ids=[r["id"] for r in NEMO])
def test_nemo_rows_are_the_quoted_configs(row):
    """| Model | #-GPUs | GBS | MBS | Sequence Length | TP | PP | CP | VP | Tokens / sec / GPU | ... |"""
    c = _cells(row["quote"])
    s = ExperimentSpec.for_prediction(published_row(row["id"]).spec)
    p = s.parallel
    assert (p.world_size, s.train.global_batch, s.train.micro_batch, s.model.seq_len, p.tp, p.pp, p.cp,
            p.virtual_stages) == tuple(int(x) for x in c[1:9])
    assert (row["published"]["value"] == int(c[9]) and str(s.train.stack) == "megatron"
            and str(s.train.precision) == "fp8")


def published_row(rid: str):
    return next(r for r in published_rows() if r.id == rid)


def test_torchtitan_rows_name_their_stack_settings():
    """torch.compile rows are elementwise compiled, Float8 rows fp8, AsyncTP rows tp_overlap; the Grand Teton rows
    run on the 96 GB / 500 W profile, with the published peak memory kept for the memory model."""
    assert len(TITAN) >= 30
    for row in TITAN:
        t = row["spec"]["train"]
        assert t["stack"] == "torchtitan", row["id"]
        assert ("compile" in row["id"] or "asynctp" in row["id"] or "trainy" in row["id"] or "-t2-" in row["id"]
                or "-t4-" in row["id"] or "-t5-" in row["id"]
                or "-t6-" in row["id"]) == (t.get("elementwise") == "compiled")
        asynctp = ("async" in row["id"] and "vanilla" not in row["id"]) or "-t5-" in row["id"] or "-t6-" in row["id"]
        assert asynctp == bool(t.get("tp_overlap")), row["id"]  # Tables 5 and 6 name "+ AsyncTP" in their headings
        assert row["hardware"] == ("h200" if "trainy" in row["id"] else "h100-96gb-hbm2e-500w")
    t4 = published_row("titan-202412-t4-70b-2d")
    assert t4.memory_gib == 71.9 and t4.spec["parallel"]["tp"] == 8 and t4.spec["train"]["precision"] == "fp8"


def test_grand_teton_profile_is_its_own():
    gt, sxm = get_hardware("h100-96gb-hbm2e-500w"), get_hardware("h100-sxm")
    assert gt.hbm_bytes_per_s == 2.4e12 and gt.memory_bytes == 96e9 and gt.device_class == "sm90"
    assert "500W power limit" in gt.source and "2.4 TB/sec" in gt.source and gt.hbm_bytes_per_s < sxm.hbm_bytes_per_s


def test_the_500w_limit_caps_gemms_at_what_fbgemm_measured_on_a_500w_h100():
    """FBGEMM#2546's kernel microbenchmarks on a 500 W H100: bf16 GEMMs at most 585.23 TFLOP/s, fp8 1,141.38. A large
    GEMM runs at that ceiling; a small one, which the H200-measured table puts below it, is not slowed; h100-sxm (700 W)
    has no ceiling."""
    from dataclasses import replace

    from backend.analytic.steptime.ops import dtype_gemm_time, float8_gemm_time

    gt = get_hardware("h100-96gb-hbm2e-500w")
    assert gt.sustained_flops == {"bf16": 585.23e12, "fp8": 1141.38e12} and "FBGEMM#2546" in \
        gt.provenance["sustained_flops"]
    assert get_hardware("h100-sxm").sustained_flops == {}
    uncapped = replace(gt, sustained_flops={}, memo={})
    big, small = (8192, 8192, 8192), (256, 1024, 1024)
    assert 2 * 8192 ** 3 / dtype_gemm_time(gt, "bf16", *big, 2) == pytest.approx(585.23e12)
    assert dtype_gemm_time(uncapped, "bf16", *big, 2) < dtype_gemm_time(gt, "bf16", *big, 2)
    assert dtype_gemm_time(gt, "bf16", *small, 2) == dtype_gemm_time(uncapped, "bf16", *small, 2)
    assert 2 * 8192 ** 3 / float8_gemm_time(gt, *big) <= 1141.38e12 * (1 + 1e-9)


def test_megatron_h100_rows_within_the_mean_target():
    """Stack megatron on H100 (NeMo 24.07, Megatron-Bridge, Megatron-LM README rows): mean |error| <= 8%, the
    issue's target (the worst row is not within 15%: benchmarks/published_gpu.py prints it). Dense rows (group H100):
    the MoE rows (group H100 MoE, issue 35) are reported beside them, with no target yet."""
    errs = []
    for r in published_rows():
        if r.stack == "megatron" and r.hardware == "h100-sxm" and r.group == "H100":
            pred = step_time(ExperimentSpec.for_prediction(r.spec), get_hardware(r.hardware)).summary["step_s"]
            errs.append(abs(pred - r.step_s) / r.step_s)
    assert len(errs) >= 25 and statistics.mean(errs) <= 0.08, statistics.mean(errs)


def test_the_issues_megatron_script_in_fp8_is_within_10pct_of_nemos_row():
    """The only published number for the issue's recipe (Llama 3 8B, 8 H100, tp 1, pp 1, cp 2, mbs 1, gbs 128, seq 8192)
    is NeMo 24.07's FP8 row: the imported script with --fp8-format hybrid is predicted within 10% of it. No BF16 number
    is published for the script as given (research gap 1)."""
    script = (Path(__file__).resolve().parents[1] / "fixtures" / "imports" / "megatron_llama31_8b_cp2.sh").read_text()
    hw = get_hardware("h100-sxm")
    fp8 = ExperimentSpec.for_prediction(import_args(script.rstrip() + " --fp8-format hybrid\n").spec)
    bf16 = ExperimentSpec.for_prediction(import_args(script).spec)
    published = published_row("nemo2407-h100-llama3-8b-g8").step_s
    pred = step_time(fp8, hw).summary["step_s"]
    assert abs(pred - published) / published <= 0.10, (pred, published)
    assert step_time(bf16, hw).summary["step_s"] > pred


def test_every_stack_has_published_rows():
    """`published --summary` prints a line per stack and GPU: no stack of the table is left without evidence."""
    assert {r.stack for r in published_rows()} == set(STACK_CHOICES)


@pytest.mark.parametrize("row", MTNLG, ids=[r["id"] for r in MTNLG])
def test_mtnlg_rows_are_the_quoted_configs(row):
    """MT-NLG 530B on 280, 350 and 420 DGX A100 nodes (8 GPUs each), batch 1920, TP 8 x PP 35: the node count in the
    row's id is the world size, and its iteration time is the quoted one for that count."""
    nodes = int(row["id"].removeprefix("mtnlg-530b-").removesuffix("n"))
    s = ExperimentSpec.for_prediction(published_row(row["id"]).spec)
    assert (s.parallel.world_size, s.parallel.tp, s.parallel.pp, s.train.global_batch) == (8 * nodes, 8, 35, 1920)
    assert (s.model.n_layers, s.model.d_model, s.model.n_heads, s.model.seq_len) == (105, 20480, 128, 2048)
    assert "280, 350, and 420 DGX A100 servers" in row["quote"] and "60.1, 50.2, and 44.4 seconds" in row["quote"]
    assert row["published"]["value"] == {280: 60.1, 350: 50.2, 420: 44.4}[nodes] and str(s.train.stack) == "deepspeed"


def test_mtnlg_predicted_step_shrinks_with_the_nodes_as_published():
    """Strong scaling at a fixed batch of 1920: more data-parallel pipelines, fewer microbatches each. The model's step
    falls from 280 to 420 nodes as the published one does, by a ratio within 10% of the published ratio."""
    rows = sorted((published_row(r["id"]) for r in MTNLG), key=lambda r: r.spec["parallel"]["world_size"])
    pred = [step_time(ExperimentSpec.for_prediction(r.spec), get_hardware(r.hardware)).summary["step_s"]
            for r in rows]
    assert pred[0] > pred[1] > pred[2]
    assert abs((pred[0] / pred[2]) / (rows[0].step_s / rows[2].step_s) - 1) <= 0.10, pred


def test_bloom_row_is_the_slurm_scripts_config():
    """BLOOM-176B: every setting the row's quote takes from tr11-176B-ml.slurm is the row's spec, and the iteration
    time is the chronicles' log line at GBS 2048."""
    raw = next(r for r in raw_rows() if r["id"] == "bloom-176b-48n")
    quote = raw["quote"]
    s = ExperimentSpec.for_prediction(published_row("bloom-176b-48n").spec)
    slurm = {"TP_SIZE": s.parallel.tp, "PP_SIZE": s.parallel.pp, "MICRO_BATCH_SIZE": s.train.micro_batch,
             "GLOBAL_BATCH_SIZE": s.train.global_batch, "NHIDDEN": s.model.d_model, "NLAYERS": s.model.n_layers,
             "NHEADS": s.model.n_heads, "SEQ_LEN": s.model.seq_len}
    assert all(f"{name}={value}," in quote for name, value in slurm.items()), slurm
    assert "NNODES 48 x GPUS_PER_NODE 8" in quote and s.parallel.world_size == 48 * 8
    assert f"--pad-vocab-size-to {s.model.vocab_size}" in quote and str(s.train.recompute) == "full"
    assert "elapsed time per iteration (s): 105.22" in quote and raw["published"]["value"] == 105.22
    assert str(s.train.stack) == "deepspeed" and str(s.parallel.strategy) == "zero1"


MPT = [r for r in raw_rows() if r["id"].startswith("mpt-")]


def test_mpt_rows_keep_the_fused_cross_entropy_llm_foundry_runs():
    """llm-foundry's default loss_fn 'fused_crossentropy' (flash-attn's fused cross-entropy) keeps what this engine's
    compiled loss keeps: every MPT row says so and sets loss_compiled; without it the 760m row's 24 x 2048 x 50,368
    logits would not fit the 80 GB H100 it ran on."""
    assert len(MPT) == 27
    for row in MPT:
        assert row["spec"]["train"]["loss_compiled"] is True, row["id"]
        assert any("'fused_crossentropy'" in n and "flash_attn/losses/cross_entropy.py" in n for n in row["notes"])
    from backend.analytic.steptime.published_check import memory_check

    row = next(r for r in published_rows() if r.id == "mpt-h100-760m-s2048-g8")
    eager = {**row.spec, "train": {**row.spec["train"], "loss_compiled": False}}
    assert memory_check(row.spec, row.hardware).verdict == "fits"
    assert memory_check(eager, row.hardware).verdict == "does not fit"


def test_no_published_recipe_is_predicted_not_to_fit_the_gpu_it_ran_on():
    """Issue 34's memory target: every published recipe predicted to fit its GPU (tight: only the allocator's
    unpressured slack over, which PyTorch frees before an out-of-memory error)."""
    from backend.analytic.steptime.published_check import check_rows

    verdicts = {c.row.id: c.memory.verdict for c in check_rows() if c.memory is not None}
    assert len(verdicts) > 100
    assert [rid for rid, v in verdicts.items() if v == "does not fit"] == []
