"""The trace's local stand-in for pipelining's meta exchange, on a traced last stage (a trace rank process)."""

from __future__ import annotations


def test_pipeline_last_stage_traces_with_the_local_meta_exchange() -> None:
    """The receiving stage (rank 1 of pp=2) traced end to end through the installed torch's exchange."""
    from backend.spec import ExperimentSpec
    from backend.trace.trace_spec import trace_spec

    spec = ExperimentSpec.model_validate({
        "model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 32, "vocab_size": 256},
        "train": {"global_batch": 4, "micro_batch": 1},
        "parallel": {"strategy": "pp", "world_size": 2, "pp": 2, "pp_schedule": "1f1b"}})
    res = trace_spec(spec, ranks=[1])
    assert res["status"] == "ok", res
    (row,) = res["per_rank"]
    for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert abs(row["error_pct"][key]) <= 1.0, (key, row["traced"], row["predicted"])
    assert abs(row["error_pct"]["activations_bytes"]) <= 10.0, (row["traced"], row["predicted"])
