"""fp16-mixed loss scaling in the engine (strategies/scaler.py, wired into strategies/step.py and pp.py): parity with
the single-process reference (which scales the same way) and one skip agreed by every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backend.engine.notes import PARITY_BOUND
from tests.helpers.mp_launch import tiny

FP16 = {"precision": "fp16-mixed"}
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_fp16_world2_matches_the_scaled_reference(tmp_path):
    """ddp, zero3, tp and pp (1f1b) at world 2 under fp16-mixed: every rank steps through the loss scaler
    (its report covers every engine step), the losses are the unscaled ones and match the reference at the
    fp16 parity bound (engine/notes.PARITY_BOUND)."""
    from tests.helpers.engine_batch import launch

    train = FP16 | {"warmup_steps": 1}
    specs = [tiny("fp16_ddp", strategy="ddp", world_size=2, train=train),
             tiny("fp16_zero3", strategy="zero3", world_size=2, train=train),
             tiny("fp16_tp", strategy="tp", world_size=2, train=train),
             tiny("fp16_pp", strategy="pp", world_size=2, pp_schedule="1f1b", train=train)]
    runs = launch(2, specs, tmp_path)
    for s in specs:
        res, ranks = runs[s.name]["result"], runs[s.name]["ranks"]
        assert len(res.loss_reference) == len(res.loss) == 3
        torch.testing.assert_close(res.loss, res.loss_reference, atol=PARITY_BOUND["fp16-mixed"], rtol=0, msg=s.name)
        assert 3.5 < res.loss[0] < 5.0, (s.name, res.loss)  # ln(64) ≈ 4.16: unscaled, not x 65536
        n_steps = len(res.loss) + 1 + min(3, s.train.steps)  # warm-up + timed, memory step, comm-timing steps
        for r in ranks:
            assert r["extra"]["loss_scaling"]["steps"] == n_steps, (s.name, r["extra"])
        assert res.loss_scaling_skipped_steps == ranks[0]["extra"]["loss_scaling"]["skipped_steps"]
        assert any(n.startswith("fp16 loss scaling") for n in res.notes)


INJECT = [dict(strategy="tp", world_size=2), dict(strategy="zero3", world_size=2),
          dict(strategy="pp", world_size=2, pp_schedule="1f1b")]


@pytest.fixture(scope="module")
def injected(tmp_path_factory) -> dict[str, dict]:
    """tests/helpers/fp16_inject.py on the INJECT layouts, in one torchrun launch."""
    tmp = tmp_path_factory.mktemp("inject")
    paths = []
    for parallel in INJECT:
        spec = tiny(f"inject_{parallel['strategy']}", train=FP16, **parallel)
        paths.append(tmp / f"{spec.name}.json")
        paths[-1].write_text(spec.to_json())
    out = tmp / "out.json"
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "tests.helpers.fp16_inject", str(out), *map(str, paths)],
                          capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["name"]: r for r in json.loads(out.read_text())}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [p["strategy"] for p in INJECT])
def test_inf_gradient_on_one_rank_skips_the_step_on_every_rank(injected, strategy):
    """+inf in rank 1's local gradient at step 1 (tp: a DTensor shard; zero3: an FSDP2 shard; pp: the last stage's
    grads, rank 0 holding the first stage): every rank skips step 1 and only step 1."""
    res = injected[f"inject_{strategy}"]
    for r in res["per_rank"]:
        assert r["skipped"] == [1], r
        assert r["params_changed"] == [True, False, True], r  # step 1 left every local shard unchanged
        assert r["scales"] == [2.0**16, 2.0**16, 2.0**15, 2.0**15], r  # halved once, by the skip
        assert r["report"]["skipped_steps"] == [1] and r["report"]["steps"] == 3
