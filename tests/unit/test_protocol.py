"""The typed rank ⇄ launcher protocol (backend/runtime/protocol.py): each file and line round-trips through its one
writer and one reader, a run folder from before still reads and assembles, and a malformed file is a clear
error naming the file and the field (a failed run with that reason, never a traceback)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from backend.runtime import entry, protocol
from backend.runtime.protocol import Fault, Progress, ProtocolError, RankError, RankPayload, RanksFile, StackFrame
from backend.spec import ExperimentSpec

OLD_RUNS = Path(__file__).parents[1] / "fixtures" / "ranks_v1"
"""ranks.json written by the engine, DeepSpeed and JAX rank programs at commit a6476c0 (before the typed
protocol), 2 ranks of the tiny model below."""
TINY = {"model": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 16},
        "train": {"global_batch": 4, "micro_batch": 2, "steps": 2, "warmup_steps": 1},
        "runtime": {"device": "cpu", "timeout_s": 120}}
OLD_SPECS = {"torch_ddp": {"parallel": {"strategy": "ddp", "world_size": 2}},
             "deepspeed_zero2": {"framework": "deepspeed", "parallel": {"strategy": "zero2", "world_size": 2}},
             "jax_ddp": {"framework": "jax", "parallel": {"strategy": "ddp", "world_size": 2}}}


def _payload(rank: int, **over) -> RankPayload:
    fields = dict(rank=rank, coords={"pp": 0, "dp": rank, "tp": 0}, strategy_module="backend.strategies.ddp",
                  losses=[2.5, float("nan")], step_s=[0.1, 0.2], comm={"all_reduce": {"calls": 1.0, "bytes": 8.0}},
                  comm_kernel={}, comm_excluded={"all_reduce": 4}, comm_group_sizes={"all_reduce": [2]},
                  memory={"categories": {"params_bytes": 1}, "rss_bytes": None}, env={"device_type": "cpu"},
                  notes=["a note"], timeline=[], extra={"loss_scaling": {"steps": 3}})
    return RankPayload(**{**fields, **over})


def test_ranks_file_round_trips_with_the_keys_earlier_versions_wrote(tmp_path):
    written = RanksFile(version=1, world_size=2, backend="gloo", ranks=[_payload(0), _payload(1)],
                        loss_reference=[2.5, 2.0])
    protocol.write_ranks(tmp_path, written)
    on_disk = json.loads((tmp_path / "ranks.json").read_text())
    assert list(on_disk) == ["version", "world_size", "backend", "ranks", "loss_reference"]  # no framework keys
    read = protocol.read_ranks(tmp_path)
    assert read.ranks[1].extra == {"loss_scaling": {"steps": 3}} and read.ranks[0].memory["rss_bytes"] is None
    assert json.dumps(read.to_dict()) == json.dumps(written.to_dict())  # NaN losses included


def test_framework_fields_kept_when_given_even_null(tmp_path):
    protocol.write_ranks(tmp_path, RanksFile(version=1, world_size=1, backend="gloo", framework="deepspeed",
                                             ds_config={"zero_optimization": {"stage": 0}}, framework_estimate=None,
                                             ranks=[_payload(0)]))
    on_disk = json.loads((tmp_path / "ranks.json").read_text())
    assert on_disk["framework_estimate"] is None and "xla" not in on_disk
    assert protocol.read_ranks(tmp_path).to_dict() == json.loads((tmp_path / "ranks.json").read_text())


@pytest.mark.parametrize("name", sorted(OLD_SPECS))
def test_a_run_folder_from_before_reads_unchanged_and_assembles(tmp_path, name):
    from backend.frameworks.assemblers import assembler_for

    text = (OLD_RUNS / f"{name}.json").read_text()
    (tmp_path / "ranks.json").write_text(text)
    payload = protocol.read_ranks(tmp_path).to_dict()
    assert payload == json.loads(text)  # what the assembler gets is exactly the file
    spec = ExperimentSpec.model_validate({**TINY, **OLD_SPECS[name]})
    result = assembler_for(spec)(spec, payload)
    assert result.status == "ok" and len(result.per_rank) == 2 and result.step_s_median > 0


def test_unknown_keys_pass_through_to_the_assembler(tmp_path):
    data = json.loads((OLD_RUNS / "torch_ddp.json").read_text())
    data["from_a_newer_writer"] = {"x": 1}
    data["ranks"][0]["per_rank_novelty"] = [1, 2]
    (tmp_path / "ranks.json").write_text(json.dumps(data))
    assert protocol.read_ranks(tmp_path).to_dict() == data


@pytest.mark.parametrize(("text", "names"), [
    ("{not json", ["is not JSON"]),
    (json.dumps({"version": 1, "world_size": 2, "backend": "gloo", "ranks": [{"rank": 0, "losses": [1.0],
                                                                              "step_s": "fast"}]}),
     ["RanksFile", "ranks.0.step_s", "valid list"]),
    (json.dumps({"version": 1, "world_size": 2, "backend": "gloo"}), ["ranks: Field required"]),
    (json.dumps({"version": 2, "world_size": 2, "backend": "gloo", "ranks": []}), ["version: Input should be 1"]),
])
def test_malformed_ranks_json_is_a_clear_error_naming_file_and_field(tmp_path, text, names):
    (tmp_path / "ranks.json").write_text(text)
    with pytest.raises(ProtocolError) as info:
        protocol.read_ranks(tmp_path)
    message = str(info.value)
    assert str(tmp_path / "ranks.json") in message and all(n in message for n in names), message


def test_launcher_turns_a_malformed_payload_into_a_failed_run_with_the_reason(tmp_path):
    from backend.launch.launcher import assembled_result

    spec = ExperimentSpec.model_validate({**TINY, **OLD_SPECS["torch_ddp"]})
    (tmp_path / "ranks.json").write_text(json.dumps({"version": 1, "world_size": 2, "backend": "gloo",
                                                      "ranks": [{"rank": "zero", "losses": [], "step_s": []}]}))
    result = assembled_result(spec, tmp_path, None, {"job_id": "j"}, "log tail")
    assert result.status == "failed" and result.traceback is None
    assert "ranks' payload is unreadable" in result.error and "ranks.0.rank" in result.error, result.error
    assert result.log_tail == "log tail" and result.per_rank  # predicted memory kept


def test_error_record_round_trip_and_root_cause_order(tmp_path):
    try:
        raise MemoryError("out of host memory")
    except MemoryError as e:
        protocol.write_rank_error(tmp_path, RankError.from_exception(1, e, oom=entry.is_oom(e)))
    (tmp_path / "rank-0.error.json").write_text(json.dumps(  # an older writer without time_unix: file time
        {"rank": 0, "error": "RuntimeError: boom", "traceback": "Traceback...", "kind": "error"}))
    os.utime(tmp_path / "rank-0.error.json", (1.0, 1.0))
    records = sorted(protocol.read_rank_errors(tmp_path), key=lambda r: r.failed_at_unix)
    assert [r.rank for r in records] == [0, 1] and records[0].failed_at_unix == 1.0
    oom = records[1]
    assert oom.kind == "oom" and oom.error == "MemoryError: out of host memory" and "raise MemoryError" in oom.traceback
    on_disk = json.loads(protocol.error_path(tmp_path, 1).read_text())
    assert set(on_disk) == {"rank", "error", "traceback", "kind", "time_unix"}


def test_malformed_error_record_is_named_and_skipped_by_the_launcher_reader(tmp_path):
    (tmp_path / "rank-2.error.json").write_text(json.dumps({"rank": 2, "kind": "segfault"}))
    with pytest.raises(ProtocolError, match=r"rank-2.error.json is not a valid RankError: error: Field required; kind"):
        protocol.read_rank_error(tmp_path / "rank-2.error.json")
    assert protocol.read_rank_errors(tmp_path) == [] and protocol.any_rank_error(tmp_path)


def test_progress_line_is_the_documented_one_and_reads_back(capsys):
    protocol.emit_progress(Progress(step=1, of=3, phase="warmup"))
    line = capsys.readouterr().err.strip()
    assert line == 'SHARDLAB_PROGRESS {"step": 1, "of": 3, "phase": "warmup"}'
    seen: list[dict] = []
    reader = protocol.progress_reader(seen.append)
    for other in ("[rank0]: SHARDLAB_PROGRESS {\"step\": 1}", "SHARDLAB_PROGRESS {oops", "plain log line"):
        reader(other)
    reader("[default0]:" + line)
    assert seen == [{"step": 1, "of": 3, "phase": "warmup"}]


def test_fault_env_round_trip_and_malformed_value_is_a_clear_error():
    assert protocol.read_fault({}) is None
    fault = Fault(kind="hang", rank=1, step=2)
    assert protocol.read_fault({protocol.FAULT_ENV: fault.env_value()}) == fault
    assert protocol.read_fault({protocol.FAULT_ENV: "raise"}) == Fault(kind="raise", rank=0, step=0)
    with pytest.raises(ProtocolError, match=r"SHARDLAB_FAULT='crash:rank=0'.*kind: Input should be 'raise'"):
        protocol.read_fault({protocol.FAULT_ENV: "crash:rank=0"})
    with pytest.raises(ProtocolError, match=r"'rank1' is not rank=R or step=S"):
        protocol.read_fault({protocol.FAULT_ENV: "raise:rank1"})


def test_stack_dump_reader_picks_the_thread_running_our_code(tmp_path):
    protocol.stack_path(tmp_path, 3).write_text(
        "Thread 0x01 (most recent call first):\n  File \"/usr/lib/python3.11/threading.py\", line 9 in wait\n\n"
        "Current thread 0x02 (most recent call first):\n  File \"/x/site-packages/torch/c10d.py\", line 5 in barrier\n"
        "  File \"/repo/backend/engine/loop.py\", line 40 in run_loop\n")
    protocol.stack_path(tmp_path, 4).write_text("")  # registered, never signalled: no stack
    (stack,) = protocol.read_stacks(tmp_path)
    assert stack.rank == 3 and stack.frames[1] == StackFrame("/repo/backend/engine/loop.py", 40, "run_loop")
    assert protocol.STACK_SIGNAL == signal.SIGUSR1


def test_rank_main_leaves_the_error_file_and_exit_code(tmp_path, monkeypatch):
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(ExperimentSpec.model_validate({**TINY, **OLD_SPECS["torch_ddp"]}).to_json())
    monkeypatch.setenv("RANK", "1")
    seen = []

    def fails(spec, rank, world, local_rank, out):
        seen.append((rank, world))
        raise RuntimeError("step 3 went wrong")

    out = tmp_path / "run"
    assert entry.rank_main(fails, "test", ["--spec", str(spec_path), "--out", str(out)]) == 1
    (record,) = protocol.read_rank_errors(out)
    assert (record.rank, record.kind, record.error) == (1, "error", "RuntimeError: step 3 went wrong")
    assert protocol.stack_path(out, 1).exists()  # registered for the launcher's timeout diagnosis
    assert entry.rank_main(fails, "test", ["--spec", str(spec_path), "--out", str(out)], one_process=True) == 1
    assert seen == [(1, 1), (0, 1)] and protocol.error_path(out, 0).exists()
    assert entry.rank_main(lambda *a: None, "test", ["--spec", str(spec_path), "--out", str(tmp_path / "ok")]) == 0


def test_clear_rank_outputs_removes_only_protocol_files(tmp_path):
    for name in ("ranks.json", "rank-0.error.json", "rank-1.stack.txt", "rank-1.progress", "spec.json", "log.txt"):
        (tmp_path / name).write_text("{}")
    protocol.clear_rank_outputs(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.txt", "spec.json"]
