"""The test farm itself (tests/helpers/farm.py): jobs share a launch, and a job that raises or hangs fails alone, with
its own error, while the jobs after it run in a new launch."""

from __future__ import annotations

import psutil
import pytest

from tests.helpers.farm import Farm, JobFailed, program_job


@pytest.mark.slow
def test_a_raising_or_hanging_job_fails_alone_and_the_rest_still_run(tmp_path):
    ok = program_job("selftest", 2)
    raises = program_job("selftest", 2, raise_on=1)
    hangs = program_job("selftest", 2, timeout_s=20, hang_on=0)
    after = program_job("selftest", 2, after=True)
    farm = Farm(tmp_path, [ok, raises, hangs, after])
    farm.run()
    assert farm.result(ok) == 3 and farm.result(after) == 3  # 1 + 2: the all-reduce over both ranks
    with pytest.raises(JobFailed, match=r"failed: .*selftest raised on rank 1") as failed:
        farm.result(raises)
    assert "Traceback" in str(failed.value)
    with pytest.raises(JobFailed, match=r"timeout: did not finish within its 20 s \(launch killed\); "
                                                     r"rank 0 is holding the job up"):
        farm.result(hangs)
    assert len(list(tmp_path.glob("launch-w2-*.log"))) == 3  # ok + raises, hangs, after
    plan = str(tmp_path)  # every rank's command line names its launch's plan file, under tmp_path
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if plan in " ".join(p.info["cmdline"] or [])]
    assert not left, f"ranks of the killed launch still running: {left}"
