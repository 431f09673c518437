"""`estimate` at a million ranks (issue 21 item 7: under 1 s and 200 MB).

  .venv/bin/python benchmarks/estimate_scale.py

For a Llama-2-70B shape (and an 8-expert MoE) on about 1,000,000 ranks in several layouts (pure dp with DDP, ZeRO-1
and FSDP, whose optimizer shares and tail chunks differ per dp index; tp x pp x dp; expert parallel), each case in a
fresh process with the modules already imported (the dashboard and a CLI process import them once; `estimate` on
a host without a GPU also imports torch to resolve device `auto`, ~235 MB and seconds, whatever the world size):
- CLI: `backend.cli.main(["estimate", ..., "--json"])` end to end (argument parsing, spec validation, the
  per-class prediction, the printed page of 1,024 ranks + the per-class summary as JSON);
- dashboard: the live prediction (dashboard.predict_view.predict + fit_check + comm_frame), the same path the
  New-experiment page runs;
each with wall time and the peak resident memory it added, next to the same at about 1,000 ranks.
The last line says whether every million-rank case met the target.
"""

from __future__ import annotations

import contextlib
import io
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA70B = ["--vocab", "32000", "--hidden", "8192", "--layers", "80", "--heads", "64", "--kv-heads", "8",
            "--ffn", "28672", "--seq", "4096", "--norm", "rmsnorm", "--mlp", "swiglu", "--positions", "rope",
            "--bias", "none"]
MOE = ["--vocab", "32000", "--hidden", "4096", "--layers", "32", "--heads", "32", "--kv-heads", "8", "--ffn", "14336",
       "--seq", "4096", "--experts", "8", "--top-k", "2", "--norm", "rmsnorm", "--mlp", "swiglu", "--positions", "rope",
       "--bias", "none"]
CASES = {
    "ddp": (LLAMA70B, {"strategy": "ddp"}),
    "zero1": (LLAMA70B, {"strategy": "zero1"}),
    "fsdp": (LLAMA70B, {"strategy": "fsdp"}),
    "zero2 tp8 pp8": (LLAMA70B, {"strategy": "zero2", "tp": 8, "pp": 8}),
    "zero3 ep8 (MoE)": (MOE, {"strategy": "zero3", "ep": 8}),
}
TARGET_S, TARGET_MB = 1.0, 200.0


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _world(target: int, parallel: dict) -> int:
    unit = parallel.get("tp", 1) * parallel.get("pp", 1) * parallel.get("ep", 1)
    return target // unit * unit


def _argv(model: list[str], parallel: dict, world: int) -> list[str]:
    dp = world // (parallel.get("tp", 1) * parallel.get("pp", 1))
    out = ["estimate", *model, "--strategy", parallel["strategy"], "--world", str(world), "--global-batch",
           str(dp * parallel.get("pp", 1)),
           "--micro-batch", "1", "--json"]
    for k in ("tp", "pp", "ep"):
        if k in parallel:
            out += [f"--{k}", str(parallel[k])]
    return out


def measure(case: str, world: int) -> dict:
    """Both paths of one case in this process (imports done first; each path in its own process would repeat them)."""
    from backend.cli import build_parser
    from backend.cli import main as cli
    from backend.spec import ExperimentSpec
    from dashboard.predict_view import comm_frame, fit_check, predict, shown_ranks

    model, parallel = CASES[case]
    import torch  # noqa: F401

    import backend.engine.device_facts  # noqa: F401  (torch, imported by the CLI's device resolution: not per world)

    build_parser()  # imports every command's module once

    base = _rss_mb()
    t0 = time.perf_counter()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli(_argv(model, parallel, world)) == 0
    cli_s = time.perf_counter() - t0
    printed = len(json.loads(buf.getvalue())["per_rank"])
    del buf
    cli_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    data = dict(zip(model[::2], model[1::2], strict=False))
    spec_model = {"vocab_size": int(data["--vocab"]), "d_model": int(data["--hidden"]),
                  "n_layers": int(data["--layers"]), "n_heads": int(data["--heads"]),
                  "n_kv_heads": int(data["--kv-heads"]), "ffn_hidden": int(data["--ffn"]),
                  "seq_len": int(data["--seq"]), "n_experts": int(data.get("--experts", 0)),
                  "top_k": int(data.get("--top-k", 2)), "norm": "rmsnorm", "mlp": "swiglu", "positions": "rope",
                  "bias": "none"}
    dp = world // (parallel.get("tp", 1) * parallel.get("pp", 1))
    base = max(base, _rss_mb())
    t0 = time.perf_counter()
    spec = ExperimentSpec.for_prediction({"model": spec_model, "train": {"global_batch": dp * parallel.get("pp", 1),
                                                                         "micro_batch": 1},
                                          "parallel": {**parallel, "world_size": world}})
    est, rows = predict(spec)
    fit = fit_check(rows, 80e9)
    comm_frame(shown_ranks(est))
    ui_s = time.perf_counter() - t0
    ui_mb = max(0.0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base)
    return {"cli_s": cli_s, "cli_mb": cli_mb, "printed": printed, "ui_s": ui_s, "ui_mb": ui_mb, "rows": len(rows),
            "classes": len(est.distinct_ranks), "worst_gb": fit.worst_bytes / 1e9}


def main() -> None:
    met = True
    print("estimate at scale (fresh process per line; time and peak memory added by the call, imports excluded)")
    for case, (_, parallel) in CASES.items():
        for target in (1_000, 1_000_000):
            world = _world(target, parallel)
            out = subprocess.run([sys.executable, __file__, "--case", case, str(world)], cwd=ROOT, capture_output=True,
                                 text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            ok = (target < 1_000_000
                  or max(r["cli_s"], r["ui_s"]) < TARGET_S and max(r["cli_mb"], r["ui_mb"]) < TARGET_MB)
            met &= ok
            print(f"  {case:16s} world {world:>9,}: CLI {r['cli_s']:.3f} s +{r['cli_mb']:.0f} MB ({r['printed']} ranks "
                  f"printed) | dashboard {r['ui_s']:.3f} s +{r['ui_mb']:.0f} MB ({r['rows']} chart rows) | "
                  f"{r['classes']} distinct predictions, worst {r['worst_gb']:.1f} "
                  f"GB{'' if ok else '  <- over target'}")
    print(f"  TARGET estimate for 1,000,000 ranks < {TARGET_S:.0f} s and < {TARGET_MB:.0f} MB (CLI and dashboard): "
          f"{'met' if met else 'MISSED'}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--case"]:
        print(json.dumps(measure(sys.argv[2], int(sys.argv[3]))))
    else:
        main()
