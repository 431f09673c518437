"""torch FSDP2 CPUOffloadPolicy (offload=params) end to end through the launcher."""

from __future__ import annotations

from backend.spec import ExperimentSpec

TINY = {"model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
        "train": {"global_batch": 4, "micro_batch": 1, "steps": 2, "warmup_steps": 1}}


def test_zero3_offload_end_to_end(tmp_path) -> None:
    from backend.launch.launcher import run_experiment

    spec = ExperimentSpec.model_validate({**TINY, "parallel": {"strategy": "zero3", "world_size": 2, "offload": "params"},
                                          "runtime": {"device": "cpu", "timeout_s": 400}})
    res = run_experiment(spec, workdir=tmp_path / "run")
    assert res.status == "ok", (res.error, (res.log_tail or "")[-3000:])
    assert res.loss_max_abs_diff is not None and res.loss_max_abs_diff <= 1e-4
    for rr in res.per_rank:
        o = rr.offload
        assert o is not None and o.host_bytes_measured > 0 and o.device_bytes_measured > 0
        assert abs(o.host_bytes_measured - o.host_bytes_predicted) <= 0.02 * o.host_bytes_predicted, o
    assert any("CPUOffloadPolicy" in n for n in res.notes)
