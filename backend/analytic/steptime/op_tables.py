"""Per-device operation tables of a hardware profile: what one GPU achieves on each operation class of a training
step, keyed by shape, with where every value comes from (pure Python + numpy).

- `GemmTable` (per dtype): fraction of the dtype's dense peak a (M, K) x (K, N) GEMM reaches, by shape. A query
  between measured shapes is the inverse-distance-weighted mean of its 4 nearest rows in (log2 M, log2 K, log2 N)
  (Shepard 1968, "A two-dimensional interpolation function for irregularly-spaced data"); each coordinate is first
  clamped to the measured range, so larger GEMMs take the largest measured shapes' efficiency (Calculon, Isaev et
  al. SC'23 Sec 4, also reads measured per-size efficiency tables).
- `AttentionTable`: fraction of the dense peak of the forward and the backward of one fused attention kernel
  (flash = FlashAttention-2 in torch SDPA, efficient, cuDNN), by (seq, head_dim), causal or not, FLOPs counted as
  the FlashAttention-2 paper does (Dao 2023 Sec 4.1: forward 4·b·a·s²·d, halved when causal; backward 2.5x).
- element-wise and optimizer bandwidth: fraction of the HBM peak by operation class.
- overheads: device seconds per kernel (the floor of a tiny kernel), host seconds per kernel launch.

`tables_from_measured` builds all of them from a GPU-check probe (`measured` of a profile written by
`python -m backend.bench.hw_probe --device cuda`); the shipped profiles read named tables from op_tables.json.
A probe that timed one call per pair of CUDA events on an idle GPU (`measured.timing` absent: every probe before
the burst timing of bench/op_timing.py) has the host's launch of that call inside each span: the GPU records the
start event at once and then waits for the kernel. Those rows are corrected by the probe's own measured host
seconds per launch (`launch.host_s_per_launch`), subtracted once per timed call (never below half the span); the
attention backward is already a difference of two such spans. The kernel floor is the larger of the probe's device
and host seconds per tiny kernel: eager PyTorch cannot issue kernels faster than its host launches them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from backend.analytic.scalar_or_array import Num

NEIGHBOURS = 4
ADAMW_BYTES_PER_PARAM = 28
"""AdamW per fp32 element: reads p, g, m, v and writes p, m, v (Loshchilov & Hutter 2019 Alg. 2; the probe's
bytes_per_s counts the same 28 B)."""
ELEMENTWISE_CLASSES = ("copy", "rmsnorm", "layernorm", "swiglu", "gelu", "cross_entropy")


@dataclass(frozen=True)
class GemmTable:
    """Efficiency (fraction of peak) of GEMMs by (m, k, n)."""

    rows: tuple[tuple[int, int, int, float], ...]
    source: str = ""

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("a GEMM table needs at least one (m, k, n, efficiency) row")
        logs = np.log2(np.asarray([r[:3] for r in self.rows], dtype=float))
        object.__setattr__(self, "_logs", logs)
        object.__setattr__(self, "_lo_hi", (logs.min(axis=0), logs.max(axis=0)))
        object.__setattr__(self, "_values", np.asarray([r[3] for r in self.rows], dtype=float))
        object.__setattr__(self, "_memo", {})

    def efficiency(self, m: Num, k: Num, n: Num) -> Num:
        """Fraction of peak of (m, k) x (k, n) GEMMs; scalars or arrays (broadcast; one lookup per distinct shape,
        the shapes not seen before interpolated together)."""
        if not any(isinstance(v, np.ndarray) for v in (m, k, n)):
            key = (float(m), float(k), float(n))
            hit = self._memo.get(key)
            if hit is None:
                self._fill([key])
                hit = self._memo[key]
            return hit
        mm, kk, nn = np.broadcast_arrays(np.asarray(m, float), np.asarray(k, float), np.asarray(n, float))
        if mm.size <= 64:  # a few shapes: a dictionary lookup each beats sorting them
            keys = list(zip(mm.ravel().tolist(), kk.ravel().tolist(), nn.ravel().tolist(), strict=False))
            self._fill(list(dict.fromkeys(q for q in keys if q not in self._memo)))
            return np.asarray([self._memo[q] for q in keys], dtype=float).reshape(mm.shape)
        rows, inverse = np.unique(np.stack([mm.ravel(), kk.ravel(), nn.ravel()], axis=1), axis=0, return_inverse=True)
        keys = [tuple(r) for r in rows.tolist()]
        self._fill([q for q in keys if q not in self._memo])
        return np.asarray([self._memo[q] for q in keys], dtype=float)[inverse.ravel()].reshape(mm.shape)

    def _fill(self, keys: list[tuple[float, float, float]]) -> None:
        """Interpolate every query of `keys` at once (module docstring) into the memo."""
        if not keys:
            return
        lo, hi = self._lo_hi
        q = np.clip(np.log2(np.maximum(np.asarray(keys, dtype=float), 1.0)), lo, hi)  # (Q, 3)
        d2 = ((q[:, None, :] - self._logs[None, :, :]) ** 2).sum(axis=2)  # (Q, R)
        k = min(NEIGHBOURS, d2.shape[1])
        near = np.argsort(d2, axis=1, kind="stable")[:, :k]  # ties: the lower row first
        dn = np.take_along_axis(d2, near, axis=1)
        vals = self._values[near]
        exact = dn[:, 0] < 1e-12
        w = 1.0 / np.where(exact[:, None], 1.0, dn)
        out = np.where(exact, vals[:, 0], (w * vals).sum(axis=1) / w.sum(axis=1))
        self._memo.update(zip(keys, out.tolist(), strict=False))


def per_unique(fn: Any, *columns: Any) -> Any:
    """fn(*row) (floats) once per distinct row of the broadcast columns, spread back as a float array (tuples of
    results: a trailing axis). Scalar columns stay fixed."""
    shape = np.broadcast_shapes(*(np.shape(c) for c in columns))
    varying = [i for i, c in enumerate(columns) if np.ndim(c)]
    codes, key = [], np.zeros(int(np.prod(shape)), dtype=np.int64)
    for i in varying:
        values, code = np.unique(np.broadcast_to(np.asarray(columns[i], dtype=float), shape).ravel(),
                                 return_inverse=True)
        codes.append(values)
        key = key * len(values) + code
    distinct, inverse = np.unique(key, return_inverse=True) if len(varying) > 1 else (np.arange(len(codes[0])), key)
    rows = []
    for d in distinct.tolist():
        row = [float(c) if not np.ndim(c) else 0.0 for c in columns]
        for i, values in zip(reversed(varying), reversed(codes), strict=False):
            d, r = divmod(d, len(values))
            row[i] = float(values[r])
        rows.append(fn(*row))
    out = np.asarray(rows, dtype=float)
    return out[inverse].reshape(shape + out.shape[1:])


def _idw(points: np.ndarray, values: np.ndarray, q: np.ndarray) -> float:
    d2 = ((points - q) ** 2).sum(axis=1)
    nearest = np.argsort(d2, kind="stable")[:NEIGHBOURS]
    if d2[nearest[0]] < 1e-12:
        return float(values[nearest[0]])
    w = 1.0 / d2[nearest]
    return float((w * values[nearest]).sum() / w.sum())


@dataclass(frozen=True)
class AttentionRow:
    kernel: str
    seq: int
    head_dim: int
    causal: bool
    fwd: float
    bwd: float


@dataclass(frozen=True)
class AttentionTable:
    rows: tuple[AttentionRow, ...]
    source: str = ""

    def kernels(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.kernel for r in self.rows))

    def __post_init__(self) -> None:
        object.__setattr__(self, "_memo", {})

    def efficiency(self, kernel: str, seq: float, head_dim: float, causal: bool = True) -> tuple[float, float] | None:
        """(forward, backward) fraction of peak of `kernel` at (seq, head_dim): the rows of that kernel and
        causality (else any causality), inverse-distance weighted in (log2 seq, log2 head_dim); None if the table
        has no row of that kernel."""
        key = (kernel, float(seq), float(head_dim), bool(causal))
        if key not in self._memo:
            self._memo[key] = _attn_eff(self.rows, *key)
        return self._memo[key]


def _attn_eff(rows: tuple[AttentionRow, ...], kernel: str, seq: float, head_dim: float, causal: bool
              ) -> tuple[float, float] | None:
    mine = [r for r in rows if r.kernel == kernel and r.causal == causal] or [r for r in rows if r.kernel == kernel]
    if not mine:
        return None
    pts = np.log2(np.asarray([(r.seq, r.head_dim) for r in mine], dtype=float))
    q = np.clip(np.log2([max(seq, 1.0), max(head_dim, 1.0)]), pts.min(axis=0), pts.max(axis=0))
    return (_idw(pts, np.asarray([r.fwd for r in mine]), q), _idw(pts, np.asarray([r.bwd for r in mine]), q))


@dataclass(frozen=True)
class OpTables:
    """Everything a profile knows per operation class; empty parts fall back to the profile's scalar tunables."""

    gemm: dict[str, GemmTable] = field(default_factory=dict)
    """By matmul dtype: bf16 (also fp16), fp8, and fp8_rowwise (rowwise-scaled fp8, ops.FP8_ROWWISE)."""
    attention: AttentionTable | None = None
    elementwise: dict[str, float] = field(default_factory=dict)
    """Fraction of the HBM peak by class: copy, rmsnorm, layernorm, swiglu, gelu, cross_entropy."""
    optimizer: dict[str, float] = field(default_factory=dict)
    """Fraction of the HBM peak of an AdamW step over ADAMW_BYTES_PER_PARAM per element, by implementation
    (foreach: torch's default on CUDA, fused)."""
    kernel_s: float | None = None
    """Device seconds of one tiny kernel when the queue is full: the floor of every kernel."""
    host_launch_s: float | None = None
    """Host seconds to launch one kernel from Python."""
    sources: dict[str, str] = field(default_factory=dict)

    def gemm_table(self, dtype: str) -> GemmTable | None:
        return self.gemm.get(dtype) or (self.gemm.get("bf16") if dtype == "fp16" else None)


def _device_s(seconds: float, launch_s: float) -> float:
    """A timed span without the host launch inside it (module docstring), never below half of it."""
    return max(seconds - launch_s, 0.5 * seconds)


def gemm_rows(rows: list[dict[str, Any]], peak: float,
              launch_s: float = 0.0) -> tuple[tuple[int, int, int, float], ...]:
    """The probe's GEMM rows {m, k, n, flops, seconds} as (m, k, n, fraction of `peak`)."""
    out = [(int(r["m"]), int(r["k"]), int(r["n"]), float(r["flops"]) / _device_s(float(r["seconds"]), launch_s) / peak)
           for r in rows if r.get("seconds") and r.get("flops") and not r.get("error")]
    return tuple(sorted(out))


def attention_rows(rows: list[dict[str, Any]], peak: float, launch_s: float = 0.0) -> tuple[AttentionRow, ...]:
    """The probe's SDPA rows; one row per (kernel, seq, head_dim, causal): the median over batch and heads."""
    groups: dict[tuple, list[tuple[float, float]]] = {}
    for r in rows:
        if r.get("error") or not r.get("fwd_s") or not r.get("bwd_s") or not r.get("fwd_flops"):
            continue
        fwd = r["fwd_flops"] / _device_s(r["fwd_s"], launch_s)
        bwd = r["bwd_flops"] / r["bwd_s"]  # (forward + backward) - forward: the launch in both spans cancels
        groups.setdefault((r["kernel"], int(r["seq"]), int(r["head_dim"]), bool(r["causal"])), []).append((fwd, bwd))
    return tuple(AttentionRow(kernel=k, seq=s, head_dim=d, causal=c, fwd=statistics.median(x[0] for x in g) / peak,
                              bwd=statistics.median(x[1] for x in g) / peak)
                 for (k, s, d, c), g in sorted(groups.items()))


def elementwise_fractions(rows: list[dict[str, Any]], hbm_bytes_per_s: float,
                          launch_s: float = 0.0) -> dict[str, float]:
    """Median bytes/s per class (rmsnorm_fwd -> rmsnorm, cross_entropy_fwd_bwd -> cross_entropy) / HBM peak."""
    by: dict[str, list[float]] = {}
    for r in rows:
        if r.get("error") or not r.get("bytes") or not r.get("seconds"):
            continue
        cls = r["op"].removesuffix("_fwd_bwd").removesuffix("_fwd")
        by.setdefault(cls, []).append(float(r["bytes"]) / _device_s(float(r["seconds"]), launch_s) / hbm_bytes_per_s)
    return {k: statistics.median(v) for k, v in by.items()}


def optimizer_fractions(rows: list[dict[str, Any]], hbm_bytes_per_s: float) -> dict[str, float]:
    return {r["impl"]: float(r["params_per_s"]) * ADAMW_BYTES_PER_PARAM / hbm_bytes_per_s for r in rows
            if r.get("params_per_s") and not r.get("error")}


def tables_from_measured(measured: dict[str, Any], peak_flops: dict[str, float], hbm_bytes_per_s: float,
                         source: str) -> OpTables:
    """The operation tables of a GPU-check probe (`measured` of a profile; module docstring)."""
    launch = measured.get("launch") or {}
    in_span = float(launch.get("host_s_per_launch") or 0.0) if measured.get("timing") != "burst" else 0.0
    if in_span:
        source += f"; single-call spans less the probe's {in_span * 1e6:.1f} us host launch"
    gemm = {}
    for table_key, key in (("bf16", "gemm_bf16"), ("fp8", "gemm_fp8"), ("fp8_rowwise", "gemm_fp8_rowwise")):
        dtype = table_key.removesuffix("_rowwise")  # rowwise-scaled fp8 runs at the fp8 peak (ops.FP8_ROWWISE)
        peak = peak_flops.get(dtype) or (2 * peak_flops["bf16"] if dtype == "fp8" and "bf16" in peak_flops else 0)
        rows = gemm_rows((measured.get(key) or {}).get("rows", []), peak, in_span) if peak else ()
        if rows:
            gemm[table_key] = GemmTable(rows=rows, source=source)
    attn = attention_rows((measured.get("attention") or {}).get("rows", []), peak_flops.get("bf16", 0), in_span) \
        if peak_flops.get("bf16") else ()
    return OpTables(gemm=gemm, attention=AttentionTable(rows=attn, source=source) if attn else None,
                    elementwise=elementwise_fractions((measured.get("elementwise") or {}).get("rows", []),
                                                      hbm_bytes_per_s, in_span),
                    optimizer=optimizer_fractions((measured.get("optimizer") or {}).get("rows", []), hbm_bytes_per_s),
                    kernel_s=max(launch.get("device_s_per_kernel") or 0.0,
                                 launch.get("host_s_per_launch") or 0.0) or None,
                    host_launch_s=launch.get("host_s_per_launch"),
                    sources={k: source for k in ("gemm", "attention", "elementwise", "optimizer", "overhead")})


def tables_from_json(entry: dict[str, Any]) -> OpTables:
    """A profile's `tables` entry (named tables already resolved): {gemm: {dtype: {rows, source}}, attention:
    {rows: [{kernel, seq, head_dim, causal, fwd, bwd}], source}, elementwise: {fractions, source}, optimizer:
    {fractions, source}, overhead: {kernel_s, host_launch_s, source}}."""
    gemm = {d: GemmTable(rows=tuple(tuple(r) for r in t["rows"]), source=t.get("source", ""))
            for d, t in (entry.get("gemm") or {}).items()}
    a = entry.get("attention")
    attn = AttentionTable(rows=tuple(AttentionRow(**r) for r in a["rows"]), source=a.get("source", "")) if a else None
    el, opt, over = entry.get("elementwise") or {}, entry.get("optimizer") or {}, entry.get("overhead") or {}
    sources = {"gemm": "; ".join(f"{d}: {t.source}" for d, t in gemm.items()), "attention": attn.source if attn else "",
               "elementwise": el.get("source", ""), "optimizer": opt.get("source", ""),
               "overhead": over.get("source", "")}
    return OpTables(gemm=gemm, attention=attn, elementwise=dict(el.get("fractions", {})),
                    optimizer=dict(opt.get("fractions", {})), kernel_s=over.get("kernel_s"),
                    host_launch_s=over.get("host_launch_s"), sources={k: v for k, v in sources.items() if v})


def table_json(t: OpTables) -> dict[str, Any]:
    """OpTables as the JSON tables_from_json reads (what `hardware --json` shows and a calibration stores)."""
    out: dict[str, Any] = {}
    if t.gemm:
        out["gemm"] = {d: {"rows": [list(r) for r in g.rows], "source": g.source} for d, g in t.gemm.items()}
    if t.attention:
        out["attention"] = {"rows": [r.__dict__ for r in t.attention.rows], "source": t.attention.source}
    if t.elementwise:
        out["elementwise"] = {"fractions": t.elementwise, "source": t.sources.get("elementwise", "")}
    if t.optimizer:
        out["optimizer"] = {"fractions": t.optimizer, "source": t.sources.get("optimizer", "")}
    if t.kernel_s is not None or t.host_launch_s is not None:
        out["overhead"] = {"kernel_s": t.kernel_s, "host_launch_s": t.host_launch_s,
                           "source": t.sources.get("overhead", "")}
    return out


def log_mean(values: list[float]) -> float:
    return math.exp(statistics.mean(math.log(v) for v in values)) if values else float("nan")
