"""backend/spec/: property tests (random dicts never crash validate_spec; accepted specs round-trip through
JSON and can be estimated) and one example per rejection message of the issue."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend.analytic.estimate import estimate
from backend.spec import ExperimentSpec, Schedule, Strategy, validate_spec

WEIRD_INTS = st.one_of(st.integers(-3, 12), st.sampled_from([0, -1, 2**31, 10**12, -(10**12), 10**30]))
ANY_SCALAR = st.one_of(WEIRD_INTS, st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=8),
                       st.lists(st.integers(), max_size=2))
STRATEGY_NAMES = st.one_of(st.sampled_from([s.value for s in Strategy]),
                           st.sampled_from(["", "ZERO3", "zero4", "dp", "tp "]))
SCHEDULES = st.one_of(st.sampled_from([s.value for s in Schedule]), st.sampled_from(["1F1B", "pipedream", ""]))
VALUE = st.one_of(WEIRD_INTS, WEIRD_INTS, ANY_SCALAR)


def section(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    return st.fixed_dictionaries({}, optional={**fields, "bogus_field": ANY_SCALAR})


MODEL = section({k: VALUE for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden",
                                    "seq_len", "n_experts", "top_k")})
TRAIN = section({**{k: VALUE for k in ("global_batch", "micro_batch", "microbatches", "steps", "warmup_steps", "seed")},
                 "precision": st.one_of(st.sampled_from(["fp32", "bf16-mixed", "fp16-mixed", "fp8"]), ANY_SCALAR),
                 "optimizer": st.sampled_from(["adamw", "sgd", "lion"]), "lr": ANY_SCALAR,
                 "recompute": st.sampled_from(["none", "selective", "full", "half"])})
PARALLEL = section({**{k: VALUE for k in ("world_size", "dp", "tp", "pp", "ep", "virtual_stages")},
                    "strategy": STRATEGY_NAMES, "pp_schedule": SCHEDULES, "sequence_parallel": ANY_SCALAR})
RUNTIME = section({"backend": st.sampled_from(["auto", "gloo", "nccl", "mpi"]), "nnodes": VALUE, "node_rank": VALUE,
                   "rdzv_endpoint": st.one_of(st.none(), st.text(max_size=10)), "timeout_s": ANY_SCALAR})
SPEC = st.fixed_dictionaries({}, optional={"name": ANY_SCALAR, "model": MODEL, "train": TRAIN, "parallel": PARALLEL,
                                          "runtime": RUNTIME, "extra": ANY_SCALAR})

# Valid-leaning specs: small positive ints so that many are accepted (and estimated).
SMALL = st.integers(1, 8)
PLAUSIBLE = st.fixed_dictionaries({
    "model": st.fixed_dictionaries({"d_model": st.sampled_from([8, 12, 16, 24]), "n_heads": st.sampled_from([1, 2, 4]),
                                    "n_layers": SMALL, "vocab_size": st.integers(2, 40), "seq_len": st.integers(1, 12)},
                                   optional={"n_kv_heads": st.sampled_from([1, 2, 4]), "ffn_hidden": SMALL,
                                             "n_experts": st.integers(0, 4), "top_k": st.integers(1, 2)}),
    "train": st.fixed_dictionaries({"global_batch": st.integers(1, 16), "micro_batch": st.integers(1, 4)},
                                   optional={"precision": st.sampled_from(["fp32", "bf16-mixed"]),
                                             "optimizer": st.sampled_from(["adamw", "sgd"]),
                                             "recompute": st.sampled_from(["none", "selective", "full"])}),
    "parallel": st.fixed_dictionaries({"strategy": st.sampled_from([s.value for s in Strategy])},
                                      optional={"world_size": SMALL, "tp": st.integers(1, 4), "pp": st.integers(1, 4),
                                                "ep": st.integers(1, 4), "sequence_parallel": st.booleans(),
                                                "pp_schedule": st.sampled_from([s.value for s in Schedule]),
                                                "virtual_stages": st.integers(1, 3)}),
})

@st.composite
def consistent(draw) -> dict:
    """Mostly-valid mixes (tp/pp/ep/sp and dp flavours) so the accepted branch covers every strategy."""
    tp, pp, dp = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    moe = draw(st.booleans())
    ep = draw(st.sampled_from([1, dp])) if moe else 1
    strategy = draw(st.sampled_from(["ddp", "zero2", "zero3", "fsdp"] + (["zero1"] if tp == 1 else [])))
    if tp > 1 and draw(st.booleans()):
        strategy = "tp" if pp == 1 and dp == 1 and ep == 1 else strategy
    sched = draw(st.sampled_from([s.value for s in Schedule])) if pp > 1 else "1f1b"
    v = 2 if sched in ("interleaved_1f1b", "zero_bubble", "zbv") else 1
    mb = draw(st.integers(1, 2))
    micro = pp * draw(st.integers(1, 2))
    return {"model": {"d_model": 16, "n_heads": 4, "n_kv_heads": draw(st.sampled_from([2, 4])),
                      "n_layers": pp * v * draw(st.integers(1, 2)),
                      "vocab_size": draw(st.integers(5, 33)), "seq_len": draw(st.integers(2, 9)),
                      "n_experts": 4 if moe else 0, "top_k": 2},
            "train": {"global_batch": micro * mb * dp, "micro_batch": mb,
                      "recompute": draw(st.sampled_from(["none", "selective", "full"])),
                      "precision": draw(st.sampled_from(["fp32", "bf16-mixed"]))},
            "parallel": {"strategy": strategy, "world_size": tp * pp * dp, "tp": tp, "pp": pp, "ep": ep,
                         "sequence_parallel": tp > 1 and draw(st.booleans()), "pp_schedule": sched,
                         "virtual_stages": v}}


PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _check_outcome(spec, problems) -> None:
    if spec is None:
        assert problems and all(isinstance(p, str) and p.strip() for p in problems)
    else:
        assert problems == []
        assert isinstance(spec, ExperimentSpec)


@PROPERTY
@given(SPEC)
@pytest.mark.heavy
def test_random_dicts_never_crash(data):
    spec, problems = validate_spec(data)
    _check_outcome(spec, problems)


@PROPERTY
@given(SPEC)
@pytest.mark.heavy
def test_random_json_text_never_crashes(data):
    spec, problems = validate_spec(json.dumps(data, default=str))
    _check_outcome(spec, problems)


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.text(max_size=20), st.integers(), st.lists(st.integers(), max_size=3), st.none()))
def test_non_mapping_input_is_rejected_cleanly(data):
    spec, problems = validate_spec(data if isinstance(data, str) else data)  # type: ignore[arg-type]
    _check_outcome(spec, problems)


@PROPERTY
@given(st.one_of(PLAUSIBLE, consistent()))
@pytest.mark.heavy
def test_accepted_specs_round_trip_and_estimate(data):
    spec, problems = validate_spec(data)
    _check_outcome(spec, problems)
    if spec is None:
        return
    again, problems = validate_spec(spec.to_json())
    assert problems == [] and again == spec
    assert json.loads(again.to_json()) == json.loads(spec.to_json())
    p = spec.parallel
    assert p.dp * p.tp * p.pp == p.world_size
    assert spec.train.global_batch == spec.train.microbatches * spec.train.micro_batch * p.dp
    e = estimate(spec)
    assert len(e.per_rank) == p.world_size and all(r.total_bytes > 0 for r in e.per_rank)


@PROPERTY
@given(PARALLEL)
def test_rejections_name_the_offending_values(parallel):
    spec, problems = validate_spec({"parallel": parallel})
    _check_outcome(spec, problems)
    for msg in problems:
        # every message names a field or value: "<field>=..", "<field>(..)", "loc: ... (got ..)" or a value
        assert any(ch.isdigit() for ch in msg) or "got" in msg or "=" in msg or "(" in msg, msg


# ---- one example per rejection message of the issue ----

@pytest.mark.parametrize("data,message", [
    ({"parallel": {"dp": 2, "tp": 3, "world_size": 4}}, "dp(2) * tp(3) * pp(1) = 6 != world_size(4)"),
    ({"model": {"n_heads": 8, "d_model": 64}, "parallel": {"strategy": "tp", "tp": 3, "world_size": 3}},
     "tp=3 does not divide n_heads=8"),
    ({"train": {"global_batch": 10, "micro_batch": 4}, "parallel": {"dp": 2}},
     "global batch 10 is not divisible by micro-batch 4 * dp 2"),
    ({"model": {"n_layers": 4}, "train": {"global_batch": 2, "micro_batch": 1},
      "parallel": {"strategy": "pp", "pp": 4, "pp_schedule": "1f1b"}}, "1F1B needs microbatches >= pp"),
    ({"model": {"n_experts": 6, "top_k": 2}, "parallel": {"strategy": "ep", "ep": 4, "world_size": 4},
      "train": {"global_batch": 8, "micro_batch": 1}}, "ep=4 does not divide n_experts=6"),
    ({"model": {"d_model": 10, "n_heads": 4}}, "n_heads=4 does not divide d_model=10"),
    ({"model": {"n_heads": 4, "n_kv_heads": 3, "d_model": 12}}, "n_kv_heads=3 must divide n_heads=4"),
    ({"model": {"n_experts": 2, "top_k": 3}}, "top_k=3 exceeds n_experts=2"),
    ({"parallel": {"strategy": "tp", "world_size": 1}}, "strategy tp needs tp >= 2"),
    ({"parallel": {"sequence_parallel": True}}, "sequence_parallel needs tp >= 2"),
    ({"parallel": {"ep": 2}}, "ep=2 needs a MoE model"),
    ({"model": {"n_layers": 2}, "parallel": {"strategy": "pp", "pp": 4},
      "train": {"global_batch": 4, "micro_batch": 1}}, "n_layers=2 < pp(4) * virtual_stages(1) = 4 stages"),
    ({"parallel": {"strategy": "pp", "pp": 2, "pp_schedule": "zbv", "virtual_stages": 3},
      "model": {"n_layers": 6}, "train": {"global_batch": 4, "micro_batch": 1}}, "zbv runs exactly 2 stages per rank"),
    ({"train": {"microbatches": 3, "global_batch": 8, "micro_batch": 2}},
     "microbatches=3 != global batch 8 / (micro-batch 2 * dp 1) = 4"),
    ({"runtime": {"nnodes": 2}}, "nnodes=2 needs rdzv_endpoint"),
    ({"parallel": {"strategy": "zero1", "tp": 2, "world_size": 4}, "train": {"precision": "fp16-mixed"}},
     "fp16 loss scaling over its fp32 main-grad buffers is not implemented"),
    ({"model": {"n_experts": 4}, "parallel": {"strategy": "ep", "ep": 4, "tp": 2, "world_size": 4}},
     "ep=4 does not divide dp=2 (expert-parallel ranks are carved out of the data-parallel ranks)"),
    ({"model": {"n_layers": 4}, "parallel": {"strategy": "fsdp", "pp": 2, "world_size": 4, "pp_schedule": "zbv",
      "virtual_stages": 2}, "train": {"global_batch": 8, "micro_batch": 2}}, "zbv with fsdp on dp=2 is not supported"),
    ({"parallel": {"strategy": "zero9"}}, "parallel.strategy"),
    ({"model": {"d_model": 0}}, "model.d_model"),
])
def test_rejection_messages(data, message):
    spec, problems = validate_spec(data)
    assert spec is None
    assert any(message in p for p in problems), problems


def test_pydantic_messages_show_the_input():
    _, problems = validate_spec({"model": {"n_layers": -3}, "parallel": {"strategy": "zero9"}})
    assert any("model.n_layers" in p and "-3" in p for p in problems)
    assert any("parallel.strategy" in p and "zero9" in p for p in problems)


def test_every_problem_is_reported_at_once():
    _, problems = validate_spec({"model": {"n_heads": 8, "n_kv_heads": 3, "d_model": 64, "n_experts": 2, "top_k": 3}})
    assert len(problems) == 2


def test_defaults_are_valid_and_derived():
    spec, problems = validate_spec({})
    assert problems == [] and spec.parallel.world_size == 1 and spec.train.microbatches == 4
    spec, _ = validate_spec({"parallel": {"strategy": "tp", "world_size": 4}})
    assert (spec.parallel.tp, spec.parallel.dp) == (4, 1)
