"""Engine overhead: median timed DDP step through the full engine vs a bare torch DDP loop, side by side.

  OMP_NUM_THREADS=1 .venv/bin/python benchmarks/engine_vs_bare.py [--rounds 2] [--steps 10]

Both run the same spec (world 2, small GPT) under torchrun, alternating engine / bare for --rounds
rounds so load drift on a shared machine hits both alike. Prints each round's medians, the ratio of
the medians over rounds (target: engine <= 1.03x bare), and the ratio of the best rounds (on a
contended CPU the fastest round is the one least disturbed by other processes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.launch.launcher import run_experiment  # noqa: E402
from backend.spec import ExperimentSpec  # noqa: E402


def bench_spec(steps: int) -> ExperimentSpec:
    return ExperimentSpec.model_validate({
        "name": "engine-vs-bare",
        "model": {"vocab_size": 256, "d_model": 128, "n_layers": 2, "n_heads": 4, "seq_len": 64},
        "train": {"global_batch": 8, "micro_batch": 2, "steps": steps, "warmup_steps": 2},
        "parallel": {"strategy": "ddp", "world_size": 2},
        "runtime": {"device": "cpu", "timeout_s": 600},
    })


def engine_median(spec: ExperimentSpec, workdir: Path) -> float:
    res = run_experiment(spec, workdir=workdir)
    if res.status != "ok":
        raise SystemExit(f"engine run {res.status}: {res.error}\n{res.log_tail}")
    return res.step_s_median


def bare_median(spec_path: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "benchmarks" / "bare_ddp.py"), "--spec", str(spec_path)]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600, start_new_session=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("BARE_STEP_S ")]
    if out.returncode or not lines:
        raise SystemExit(f"bare run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return statistics.median(json.loads(lines[-1].split(" ", 1)[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    spec = bench_spec(args.steps)
    engine, bare = [], []
    with tempfile.TemporaryDirectory(prefix="shardlab-bench-") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(spec.to_json())
        for r in range(args.rounds):
            engine.append(engine_median(spec, Path(tmp) / f"engine{r}"))
            bare.append(bare_median(spec_path))
            print(f"round {r + 1}: engine {engine[-1] * 1e3:.2f} ms/step, bare {bare[-1] * 1e3:.2f} ms/step, "
                  f"ratio {engine[-1] / bare[-1]:.3f}x", flush=True)
    e, b = statistics.median(engine), statistics.median(bare)
    m = spec.model
    print(f"DDP world 2, d_model {m.d_model}, {m.n_layers} layers, seq {m.seq_len}, global batch "
          f"{spec.train.global_batch}, {args.steps} timed steps x {args.rounds} rounds, load {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores")
    print(f"median timed step: engine {e * 1e3:.2f} ms, bare torch DDP {b * 1e3:.2f} ms, ratio {e / b:.3f}x (target <= 1.03x)")
    print(f"best round: engine {min(engine) * 1e3:.2f} ms, bare {min(bare) * 1e3:.2f} ms, ratio {min(engine) / min(bare):.3f}x")


if __name__ == "__main__":
    main()
