"""The benchmark scripts stay runnable: one tiny side-by-side job (engine timed steps and the bare loop in the
same processes). No timing is asserted here — speed targets live in the benchmarks themselves."""

import json

import pytest

from tests.helpers.launch import ROOT, torchrun


@pytest.mark.slow
def test_side_by_side_job_reports_both_sides_every_round(tmp_path):
    from benchmarks.engine_vs_bare import bench_spec

    spec = bench_spec(2)
    (tmp_path / "spec.json").write_text(spec.to_json())
    script = ROOT / "benchmarks" / "side_by_side.py"
    out = torchrun(2, [str(script), "--spec", str(tmp_path / "spec.json"), "--rounds", "2"], timeout_s=300)
    assert out.returncode == 0, out.stderr[-3000:]
    blocks = json.loads(next(ln for ln in out.stdout.splitlines()
                             if ln.startswith("SIDE_BY_SIDE ")).split(" ", 1)[1])["blocks"]
    assert [(b["round"], b["which"]) for b in blocks] == [(0, "engine"), (0, "bare"), (1, "bare"), (1, "engine")]
    assert all(len(b["step_s"]) == 2 and all(s > 0 for s in b["step_s"]) for b in blocks)
    assert all(len(b["cpu_s"]) == 2 and all(s > 0 for s in b["cpu_s"]) for b in blocks)


@pytest.mark.slow
def test_side_by_side_single_step_blocks_alternate_and_null_runs(tmp_path):
    from benchmarks.engine_vs_bare import bench_spec, side_by_side_rounds

    (wall, cpu) = side_by_side_rounds(bench_spec(2), rounds=1, launches=1, block=1, null=True)
    assert [len(r) for r in wall[0] + wall[1] + cpu[0] + cpu[1]] == [2, 2, 2, 2]
