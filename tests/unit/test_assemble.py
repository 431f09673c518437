"""assemble_result is a pure function of (spec, ranks.json payload): check its arithmetic and its notes."""

import pytest

from backend.analytic.estimate import estimate
from backend.engine.assemble import assemble_result, comm_error_pct
from backend.result import RunResult, Status
from backend.spec import ExperimentSpec

SPEC = {"model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 32, "vocab_size": 128},
        "train": {"global_batch": 8, "micro_batch": 2, "steps": 3, "warmup_steps": 1},
        "parallel": {"strategy": "zero3", "world_size": 2}}


def fake_payload(spec, *, scale=1.0, step_s=((0.1, 0.3, 0.2), (0.2, 0.1, 0.4)), extra_comm=None, device="cpu"):
    est = estimate(spec)
    ranks = []
    for r, pr in enumerate(est.per_rank):
        cats = {"params_bytes": int(pr.params_bytes * scale), "grads_bytes": pr.grads_bytes,
                "optimizer_bytes": pr.optimizer_bytes, "activations_bytes": pr.activations_bytes, "other_bytes": 10}
        comm = {k: {"calls": 2, "bytes": v, "wire_bytes": v / 2, "seconds": 0.01} for k, v in pr.comm_bytes.items()}
        comm.update(extra_comm or {})
        ranks.append({"rank": r, "coords": spec.parallel.coords(r), "losses": [2.0, 1.5, 1.25, 1.0],
                      "step_s": list(step_s[r]), "comm": comm, "comm_kernel": comm, "comm_excluded": {"all_reduce": 4},
                      "memory": {"categories": cats, "peak_bytes": sum(cats.values()), "at_peak": cats,
                                 "high_water": cats, "moment": "activation_peak", "rss_bytes": 1,
                                 "cuda_max_allocated_bytes": None},
                      "env": {"hostname": f"h{r}", "device_type": device, "device_name": "NVIDIA H100 80GB HBM3"
                              if device == "cuda" else "cpu", "torch": "2.13.0"},
                      "notes": ["strategy note"], "timeline": []})
    return {"version": 1, "world_size": 2, "backend": "gloo", "ranks": ranks,
            "loss_reference": [2.0, 1.5, 1.25, 1.00005]}


@pytest.fixture
def spec():
    return ExperimentSpec.model_validate(SPEC)


def test_exact_payload_gives_zero_error_and_right_arithmetic(spec):
    res = assemble_result(spec, fake_payload(spec))
    assert isinstance(res, RunResult) and res.status == Status.OK
    RunResult.from_json(res.to_json())  # round-trips through the JSON contract
    for rr in res.per_rank:
        assert all(rr.error_pct[k] == 0 for k in ("params_bytes", "grads_bytes", "optimizer_bytes",
                                                  "activations_bytes"))
        assert all(e == 0 for e in comm_error_pct(rr).values())
    # per step the slowest rank counts: max(0.1,0.2)=0.2, max(0.3,0.1)=0.3, max(0.2,0.4)=0.4 -> median 0.3
    assert res.step_s_median == pytest.approx(0.3)
    assert res.tokens_per_s == pytest.approx(8 * 32 / 0.3)
    assert res.flops_per_step == estimate(spec).flops_per_step
    assert res.achieved_flops == pytest.approx(res.flops_per_step / 0.3)
    assert res.mfu is None  # CPU: no known peak
    assert res.loss_max_abs_diff == pytest.approx(5e-5, abs=1e-9)
    assert res.env["hostnames"] == ["h0", "h1"]
    assert res.notes.count("strategy note") == 1
    assert any("gloo implements reduce_scatter" in n for n in res.notes)
    assert any("loss report" in n for n in res.notes)
    assert not any("misses" in n for n in res.notes)


def test_category_over_bound_is_explained(spec):
    res = assemble_result(spec, fake_payload(spec, scale=1.05))
    assert res.per_rank[0].error_pct["params_bytes"] == pytest.approx(5.0, abs=0.01)
    assert any(n.startswith("params_bytes misses the ±2% bound") and "rank 0" in n for n in res.notes)


def test_unpredicted_collective_is_noted(spec):
    res = assemble_result(spec, fake_payload(spec, extra_comm={"broadcast": {"calls": 1, "bytes": 64, "wire_bytes": 64,
                                                                             "seconds": 0}}))
    assert comm_error_pct(res.per_rank[0])["broadcast"] is None
    assert any("broadcast 64 B/step measured but not predicted" in n for n in res.notes)


def test_mfu_uses_known_cuda_peak(spec):
    res = assemble_result(spec, fake_payload(spec, device="cuda"))
    assert res.mfu == pytest.approx(res.achieved_flops / (67e12 * 2))


def test_loss_parity_failure_is_called_out():
    from backend.engine.assemble import parity_notes
    from backend.spec import ExperimentSpec

    spec = ExperimentSpec()
    assert parity_notes(spec, 3e-7) == []
    assert parity_notes(spec, None) == []
    (note,) = parity_notes(spec, 0.0231)
    assert "LOSS PARITY FAILS" in note and "0.0231" in note
