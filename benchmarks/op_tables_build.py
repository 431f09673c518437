"""Writes backend/analytic/steptime/op_tables.json, the named operation tables the shipped hardware profiles use.

  .venv/bin/python benchmarks/op_tables_build.py [--xla PATH/TO/matmul_interpolator_data.h]

- "gh100-probe-2026-11-26": every table of the GPU check's probe on an NVIDIA H200 (GH100: the H100 SXM's die,
  132 SMs, 1.98 GHz, 700 W), benchmarks/results/gpu/2026-11-26-h200-run1/profile.json, through
  op_tables.tables_from_measured (tests/test_op_tables.py checks the shipped copy equals it).
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

OUT = ROOT / "backend" / "analytic" / "steptime" / "op_tables.json"
PROBE = ROOT / "benchmarks" / "results" / "gpu" / "2026-11-26-h200-run1" / "profile.json"
PROBE_SOURCE = ("measured: GPU check 2026-11-26 run 1, backend/bench/hw_probe.py --device cuda on an NVIDIA H200 (GH100), "
                "torch 2.11.0+cu130, CUDA 13.0 (benchmarks/results/gpu/2026-11-26-h200-run1/profile.json)")
XLA_SOURCE = ("published: OpenXLA xla/service/gpu/model/matmul_interpolator_data.h ({arch}, commit {commit}, Aug 2025): "
              "measured GEMM FLOP/s by (m, n, k), b = 1 rows, / the dense {dtype} peak")
XLA = {"xla-sm90": ("sm_90", "b2766086ec", {"bf16": ("bf16xbf16->bf16", 989.4e12)}),
       "xla-sm100": ("sm_100_B200", "1088d5ab75", {"bf16": ("bf16xbf16->bf16", 2.25e15),
                                                  "fp8": ("f8e4m3fnxf8e4m3fn->bf16", 4.5e15)})}
FA2_A100 = {"rows": [{"kernel": "flash", "seq": 512, "head_dim": 64, "causal": False, "fwd": 0.50, "bwd": 0.43},
                     {"kernel": "flash", "seq": 16384, "head_dim": 128, "causal": False, "fwd": 0.73, "bwd": 0.63}],
            "source": "published: Dao 2023 (FlashAttention-2), abstract and Sec 4.1: 50-73% of the A100's peak, forward "
                      "up to 73%, backward up to 63% (long sequences, head dim 128); the short-sequence backward is the "
                      "same 63/73 ratio of the 50% forward"}


def _xla_rows(text: str, arch: str, key: str, peak: float) -> list[list[float]]:
    block = text.split(f'key: "{arch}"', 1)[1].split('\n  entries {\n    key: "', 1)[0]
    rows = []
    for e in re.finditer(r"entries \{\s*b: (\d+)\s*m: (\d+)\s*n: (\d+)\s*k: (\d+)\s*((?:flops \{[^}]*\}\s*)+)\}", block):
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
    why = ("copy 0.9 of the HBM peak (the former memory_efficiency); other classes x their ratio to copy measured on the "
           "GH100 probe (gh100-probe-2026-11-26)")
    tables["copy90-relative-gh100"] = {
        part: {"fractions": {k: round(0.9 * v / copy, 4) for k, v in gh[part]["fractions"].items()}, "source": why}
        for part in ("elementwise", "optimizer")}
    tables["fa2-a100"] = {"attention": FA2_A100}
    OUT.write_text(json.dumps({"_doc": "Named operation tables (backend/analytic/steptime/op_tables.py) the profiles of "
                                       "hardware.json use; written by benchmarks/op_tables_build.py.", "tables": tables},
                              separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes): {', '.join(tables)}")


if __name__ == "__main__":
    main()
