"""Context parallelism in the spec: the cp degree, its validation with the arithmetic, mesh coordinates in torchtitan's
(pp, dp, cp, tp) order, and each cp rank's share of the sequence (head-tail chunks)."""

import pytest

from backend.spec import ExperimentSpec, validate_spec
from backend.strategies.cp_layout import sequence_chunks
from backend.strategies.ring_attention import FIRST_K, FULL, SECOND_Q, SKIP, RingGroup, block_kind

FLASH = {"attention": "flash", "seq_len": 16}


def _spec(model=None, **parallel):
    return {"model": {**FLASH, **(model or {})}, "train": {"global_batch": 8, "micro_batch": 2}, "parallel": parallel}


def test_world_is_dp_cp_tp_pp_and_dp_is_derived():
    s = ExperimentSpec.model_validate(_spec(world_size=16, cp=2, tp=2, pp=2, strategy="fsdp"))
    assert (s.parallel.dp, s.parallel.dp_cp) == (2, 4)
    s = ExperimentSpec.model_validate(_spec(dp=2, cp=2))
    assert s.parallel.world_size == 4


def test_bad_degrees_name_the_arithmetic():
    _, problems = validate_spec(_spec(world_size=6, cp=4))
    assert problems == ["world_size(6) is not divisible by tp(1) * pp(1) * cp(4) = 4"]
    _, problems = validate_spec(_spec(world_size=8, dp=4, cp=4))
    assert problems == ["dp(4) * tp(1) * pp(1) * cp(4) = 16 != world_size(8)"]


def test_cp_needs_flash_attention_and_equal_chunks():
    _, problems = validate_spec(_spec(model={"attention": "math"}, world_size=2, cp=2))
    assert any(p.startswith("cp=2 needs attention=flash (got math)") for p in problems), problems
    _, problems = validate_spec(_spec(model={"seq_len": 12}, world_size=4, cp=4))
    assert "seq_len=12 does not split into 2 * cp = 8 head-tail chunks (12 % 8 = 4)" in problems
    spec, problems = validate_spec(_spec(model={"seq_len": 12}, world_size=4, cp=4, cp_load_balance=False))
    assert spec is not None, problems


def test_ep_is_carved_out_of_dp_times_cp():
    moe = {"n_experts": 4, "top_k": 2}
    spec, problems = validate_spec(_spec(model=moe, world_size=4, cp=2, ep=4, strategy="ep"))
    assert spec is not None, problems
    _, problems = validate_spec(_spec(model=moe, world_size=6, cp=3, ep=4, strategy="ep"))
    assert any("ep=4 does not divide dp * cp = 2 * 3 = 6" in p for p in problems), problems


def test_other_frameworks_refuse_cp():
    _, problems = validate_spec({**_spec(world_size=2, cp=2), "framework": "deepspeed"})
    assert any("cp=2 must be 1" in p for p in problems), problems
    _, problems = validate_spec({**_spec(world_size=2, cp=2), "framework": "jax"})
    assert any("cp=2" in p for p in problems), problems


def test_coords_follow_torchtitans_order():
    p = ExperimentSpec.model_validate(_spec(world_size=16, dp=2, cp=2, tp=2, pp=2, strategy="fsdp")).parallel
    assert p.coords(0) == {"pp": 0, "dp": 0, "cp": 0, "tp": 0, "ep": 0}
    assert p.coords(2) == {"pp": 0, "dp": 0, "cp": 1, "tp": 0, "ep": 0}
    assert p.coords(5) == {"pp": 0, "dp": 1, "cp": 0, "tp": 1, "ep": 0}
    assert p.coords(13) == {"pp": 1, "dp": 1, "cp": 0, "tp": 1, "ep": 0}
    for rank in range(16):
        c = p.coords(rank)
        assert p.rank_at(pp=c["pp"], dp=c["dp"], cp=c["cp"], tp=c["tp"]) == rank
        assert p.data_parallel_index(rank) == c["dp"] * 2 + c["cp"]
    one = ExperimentSpec.model_validate(_spec(world_size=4, tp=2)).parallel
    assert "cp" not in one.coords(3)  # specs without cp keep their coordinates


@pytest.mark.parametrize("load_balance", [True, False])
def test_sequence_chunks_cover_the_sequence_once(load_balance):
    for cp in (1, 2, 4):
        got = sorted(t for r in range(cp) for a, b in sequence_chunks(32, cp, r, load_balance) for t in range(a, b))
        assert got == list(range(32))
    assert sequence_chunks(16, 2, 0, True) == [(0, 4), (12, 16)]
    assert sequence_chunks(16, 2, 1, True) == [(4, 8), (8, 12)]
    assert sequence_chunks(16, 2, 1, False) == [(8, 16)]


def test_ring_blocks_balance_causal_work():
    """torch's load-balance note: past the local block each step computes half a block (FIRST_K or SECOND_Q) on
    every rank; contiguous chunks skip the later senders' blocks, so the last rank does the most."""
    for r in range(4):
        kinds = [block_kind(RingGroup(None, 4, r, "allgather", True), i) for i in range(4)]
        assert kinds[0] == FULL and set(kinds[1:]) <= {FIRST_K, SECOND_Q}
    work = [sum(block_kind(RingGroup(None, 4, r, "allgather", False), i) == FULL for i in range(4)) for r in range(4)]
    assert work == [1, 2, 3, 4]
    assert block_kind(RingGroup(None, 4, 0, "allgather", False), 1) == SKIP


def test_cp_note_reports_the_ring_wait_of_the_timed_steps(monkeypatch):
    """engine/accuracy_notes.cp_notes: the busiest rank's median wait over the timed steps (warm-up, memory and comm
    steps left out), its share of the step, and the step-time model's exposed ring time when a cpu profile exists."""
    from backend.engine import accuracy_notes

    spec = ExperimentSpec.model_validate({**_spec(world_size=2, cp=2), "train": {"global_batch": 8, "micro_batch": 2,
                                                                                  "steps": 3, "warmup_steps": 1}})
    ranks = [{"rank": 0, "step_s": [0.1, 0.1, 0.1], "extra": {"cp_ring": {"wait_s": [9.0, 0.01, 0.03, 0.02, 9.0]}}},
             {"rank": 1, "step_s": [0.1, 0.1, 0.1], "extra": {"cp_ring": {"wait_s": [9.0, 0.04, 0.05, 0.06, 9.0]}}}]
    monkeypatch.setattr(accuracy_notes, "_predicted_cp_exposed_s", lambda s: 0.012)
    (note,) = accuracy_notes.cp_notes(spec, ranks)
    assert note.startswith("CP ring: rank 1 waited 50.0 ms per step") and "50% of its step" in note
    assert "predicts 12.0 ms exposed on the cpu profile" in note
    monkeypatch.setattr(accuracy_notes, "_predicted_cp_exposed_s", lambda s: None)
    assert "no cpu profile" in accuracy_notes.cp_notes(spec, ranks)[0]
    assert accuracy_notes.cp_notes(ExperimentSpec.model_validate(_spec(world_size=2)), ranks) == []


def test_windows_sinks_and_mla_under_cp_are_prediction_only():
    """The ring attention is plain causal attention: a window shorter than the sequence, sinks or MLA with cp > 1 are
    predicted (ExperimentSpec.for_prediction) but refused for a run (backend.spec.checks.run_blockers), each named."""
    from backend.spec.checks import run_blockers

    mla = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "positions": "rope"}
    cases = [({"window": 4}, "a sliding / chunked window"), ({"attention_sinks": True}, "attention sinks"),
             (mla, "multi-head latent attention")]
    for model, named in cases:
        spec = ExperimentSpec.for_prediction(_spec(model=model, world_size=2, cp=2))
        blockers = run_blockers(spec)
        assert any(b.startswith(f"cp=2 with {named}:") for b in blockers), (named, blockers)
        assert not any(b.startswith("cp=") for b in run_blockers(ExperimentSpec.for_prediction(_spec(model=model))))
    assert run_blockers(ExperimentSpec.model_validate(_spec(model={"window": 16}, world_size=2, cp=2))) == []
