"""Writes backend/analytic/steptime/op_tables.json, the named operation tables the shipped hardware profiles use.

  .venv/bin/python benchmarks/op_tables_build.py [--xla PATH/TO/matmul_interpolator_data.h]

- "gh100-probe-2026-11-26": every table of the GPU check's probe on an NVIDIA H200 (GH100: the H100 SXM's die,
  132 SMs, 1.98 GHz, 700 W), benchmarks/results/gpu/2026-11-26-h200-run1/profile.json, through
  op_tables.tables_from_measured (tests/unit/test_op_tables.py checks the shipped copy equals it).
- "xla-sm90", "xla-sm100": GEMM throughput by (m, n, k) that OpenXLA publishes for its GPU cost model
  (xla/service/gpu/model/matmul_interpolator_data.h, "[XLA:GPU] Update Latency-hiding scheduler cost model for
  GEMMS on H100" b2766086ec and "Update GEMM cost model for B200" 1088d5ab75, Aug 2025): the b = 1 rows as
  fractions of the dense peaks (H100 SXM bf16 989.4 TFLOP/s; B200 bf16 2.25, fp8 4.5 PFLOP/s). The sm_90 fp8
  rows are left out: they exceed the H100's fp8 dense peak (1,979 TFLOP/s), so they cannot be fractions of it.
  Without --xla the file's existing xla tables are kept.
- "copy90-relative-gh100": element-wise and optimizer fractions for profiles that measured none: copy at 0.9 of the
  HBM peak (the former global memory_efficiency, set with Narayanan 2021 Table 1 in view), every other class at its
  measured ratio to copy on the GH100 probe (same PyTorch kernels: a norm, an activation, the loss, AdamW).
- "fa2-a100": FlashAttention-2 on A100 (Dao 2023, abstract and Sec 4.1: 50-73% of the A100's peak; forward up to
  73%, backward up to 63%, at long sequences and head dim 128).
- "fa2-paper-fig4-a100", "fa2-paper-fig7-h100": the attention forward + backward TFLOP/s bar labels of the
  FlashAttention-2 paper's kernel benchmarks (Dao 2023, Fig. 4: A100 80GB SXM4; Fig. 7: H100 80GB SXM5; the
  repository's assets/flash2_a100_fwd_bwd_benchmark.png and flash2_h100_fwd_bwd_benchmark.png, FlashAttention-2
  release 4f285b35, 2023-07-17; benchmarks/benchmark_causal.py there), as fractions of the dense bf16 peak (312,
  989.4 TFLOP/s). Kernels: flash (FlashAttention-2), flash1 (FlashAttention v1, CUDA) and, on A100, flash-triton
  ("FlashAttention Triton": flash_attn/flash_attn_triton.py, the file MosaicML's llm-foundry copies as its
  `attn_impl: triton`). The figures give forward + backward only, so forward and backward get the same fraction
  (their sum, 3.5x the forward FLOPs, is then timed exactly). Bars whose label the legend hides are left out.
- "fa3-paper-h100": FlashAttention-3 (kernel flash3) on H100 SXM5 from the FlashAttention-3 paper
  (benchmarks/op_tables_fa3.py says which figures and how the backward is derived).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from backend.analytic.steptime.op_tables import table_json, tables_from_measured  # noqa: E402
from benchmarks.op_tables_fa3 import fa3_table  # noqa: E402

OUT = ROOT / "backend" / "analytic" / "steptime" / "op_tables.json"
PROBE = ROOT / "benchmarks" / "results" / "gpu" / "2026-11-26-h200-run1" / "profile.json"
PROBE_SOURCE = ("measured: GPU check 2026-11-26 run 1, backend/bench/hw_probe.py --device cuda on an NVIDIA H200 "
                "(GH100), torch 2.11.0+cu130, CUDA 13.0 (benchmarks/results/gpu/2026-11-26-h200-run1/profile.json)")
XLA_SOURCE = ("published: OpenXLA xla/service/gpu/model/matmul_interpolator_data.h ({arch}, commit {commit}, Aug "
              "2025): measured GEMM FLOP/s by (m, n, k), b = 1 rows, / the dense {dtype} peak")
XLA = {"xla-sm90": ("sm_90", "b2766086ec", {"bf16": ("bf16xbf16->bf16", 989.4e12)}),
       "xla-sm100": ("sm_100_B200", "1088d5ab75", {"bf16": ("bf16xbf16->bf16", 2.25e15),
                                                  "fp8": ("f8e4m3fnxf8e4m3fn->bf16", 4.5e15)})}
FA2_A100 = {"rows": [{"kernel": "flash", "seq": 512, "head_dim": 64, "causal": False, "fwd": 0.50, "bwd": 0.43},
                     {"kernel": "flash", "seq": 16384, "head_dim": 128, "causal": False, "fwd": 0.73, "bwd": 0.63}],
            "source": "published: Dao 2023 (FlashAttention-2), abstract and Sec 4.1: 50-73% of the A100's peak, "
                      "forward up to 73%, backward up to 63% (long sequences, head dim 128); the short-sequence "
                      "backward is the same 63/73 ratio of the 50% forward"}


FA2_PAPER_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
FA2_PAPER_URL = ("Dao 2023, 'FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning' (arXiv "
                 "2307.08691), Fig. {fig}: attention forward + backward TFLOP/s on {gpu} (github.com/Dao-AILab/"
                 "flash-attention assets/{png}, release 4f285b35); forward = backward = fwd+bwd TFLOP/s / {peak:g}")
FA2_PAPER = {  # (causal, head_dim): {kernel: TFLOP/s per FA2_PAPER_SEQS entry, None where the legend hides the label}
    "fa2-paper-fig7-h100": ("7", "H100 80GB SXM5", "flash2_h100_fwd_bwd_benchmark.png", 989.4, {
        (False, 64): {"flash1": (157, 159, 161, 161, 166, 168), "flash": (215, 254, 274, 288, 294, 296)},
        (False, 128): {"flash1": (127, 127, 128, 131, 137, 139), "flash": (248, 294, 320, 326, 335, 338)},
        (True, 64): {"flash1": (104, 123, 136, 138, 149, 156), "flash": (141, 192, 232, 257, 273, 284)},
        (True, 128): {"flash1": (98, 109, 108, 126, 135, 137), "flash": (163, 221, 265, 294, 308, 328)}}),
    "fa2-paper-fig4-a100": ("4", "A100 80GB SXM4", "flash2_a100_fwd_bwd_benchmark.png", 312.0, {
        (False, 64): {"flash1": (91, 92, 104, 108, 110, 110), "flash-triton": (90, 102, 98, 98, 100, 100),
                      "flash": (132, None, 162, 171, 175, 176)},
        (False, 128): {"flash1": (76, 72, 76, 80, 82, 83), "flash-triton": (78, 85, 90, 93, 95, 95),
                       "flash": (None, None, 187, 196, 201, 203)},
        (True, 64): {"flash1": (58, 70, 77, 87, 92, 97), "flash-triton": (59, 75, 79, 76, 79, 80),
                     "flash": (88, 119, 140, 156, 165, 171)},
        (True, 128): {"flash1": (55, 62, 69, 76, 80, 83), "flash-triton": (50, 61, 68, 74, 78, 80),
                      "flash": (99, 133, 155, 173, 182, 189)}}),
}


def fa2_paper_table(name: str, kernels: tuple[str, ...]) -> dict:
    """One FlashAttention-2 paper figure (FA2_PAPER) as an attention table of `kernels`."""
    fig, gpu, png, peak, panels = FA2_PAPER[name]
    rows = [{"kernel": k, "seq": s, "head_dim": d, "causal": c, "fwd": round(v / peak, 4), "bwd": round(v / peak, 4)}
            for (c, d), by in panels.items() for k in kernels
            for s, v in zip(FA2_PAPER_SEQS, by.get(k, ()), strict=False) if v]
    return {"rows": rows, "source": "published: " + FA2_PAPER_URL.format(fig=fig, gpu=gpu, png=png, peak=peak)}


def _xla_rows(text: str, arch: str, key: str, peak: float) -> list[list[float]]:
    block = text.split(f'key: "{arch}"', 1)[1].split('\n  entries {\n    key: "', 1)[0]
    rows = []
    for e in re.finditer(r"entries \{\s*b: (\d+)\s*m: (\d+)\s*n: (\d+)\s*k: (\d+)\s*((?:flops \{[^}]*\}\s*)+)\}",
                         block):
        b, m, n, k = map(int, e.groups()[:4])
        flops = dict(re.findall(r'key: "([^"]+)" value: (\d+)', e.group(5)))
        if b == 1 and key in flops:
            rows.append([m, k, n, round(int(flops[key]) / peak, 4)])
    return sorted(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--xla", type=Path, help="OpenXLA's matmul_interpolator_data.h (else keep the file's xla tables)")
    args = ap.parse_args()
    old = json.loads(OUT.read_text()) if OUT.exists() else {"tables": {}}
    entry = next(iter(json.loads(PROBE.read_text())["profiles"].values()))
    tables = {"gh100-probe-2026-11-26": table_json(tables_from_measured(entry["measured"], entry["peak_flops"],
                                                                        entry["hbm_bytes_per_s"], PROBE_SOURCE))}
    for name, (arch, commit, dtypes) in XLA.items():
        if args.xla:
            text = args.xla.read_text()
            tables[name] = {"gemm": {d: {"rows": _xla_rows(text, arch, key, peak),
                                         "source": XLA_SOURCE.format(arch=arch, commit=commit, dtype=d)}
                                     for d, (key, peak) in dtypes.items()}}
        elif name in old["tables"]:
            tables[name] = old["tables"][name]
    gh = tables["gh100-probe-2026-11-26"]
    copy = gh["elementwise"]["fractions"]["copy"]
    why = ("copy 0.9 of the HBM peak (the former memory_efficiency); other classes x their ratio to copy measured on "
           "the GH100 probe (gh100-probe-2026-11-26)")
    tables["copy90-relative-gh100"] = {
        part: {"fractions": {k: round(0.9 * v / copy, 4) for k, v in gh[part]["fractions"].items()}, "source": why}
        for part in ("elementwise", "optimizer")}
    tables["fa2-a100"] = {"attention": FA2_A100}
    tables["fa2-paper-fig4-a100"] = {"attention": fa2_paper_table("fa2-paper-fig4-a100",
                                                                  ("flash", "flash1", "flash-triton"))}
    tables["fa2-paper-fig7-h100"] = {"attention": fa2_paper_table("fa2-paper-fig7-h100", ("flash1",))}
    tables["fa3-paper-h100"] = {"attention": fa3_table()}
    OUT.write_text(json.dumps({"_doc": "Named operation tables (backend/analytic/steptime/op_tables.py) the profiles "
                                       "of hardware.json use; written by benchmarks/op_tables_build.py.",
                               "tables": tables},
                              separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes): {', '.join(tables)}")


if __name__ == "__main__":
    main()
