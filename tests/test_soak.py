"""The short CI variant of benchmarks/soak.py (issue 21): a few tiny real runs through 3 worker processes while a
real PostgreSQL server is stopped and started again and one worker is killed mid-run. Every run ends ok or
failed/interrupted with its reason; none lost, duplicated or mixed up. The full soak (200 runs, 2 restarts)
is `python benchmarks/soak.py`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_short_soak_loses_duplicates_and_mixes_up_nothing(pg_server, tmp_path):
    from soak import soak

    counts = soak(pg_server, runs=6, workers=3, restarts=1, outage_s=5.0, kill=True, workdir=tmp_path, timeout_s=300)
    print(json.dumps(counts, indent=1))
    assert counts["lost"] == [] and counts["duplicated"] == [] and counts["mixed_up"] == [], counts
    assert counts["without_reason"] == [] and counts["ok"] + counts["not_ok_with_reason"] == 6, counts
    assert counts["restarts_done"] == 1 and counts["ok"] >= 3, counts
    assert all(code in (0, -9) for code in counts["worker_exit_codes"]), counts
