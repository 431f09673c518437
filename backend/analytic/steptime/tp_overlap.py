"""TP collectives hidden behind the GEMMs they feed (pure Python): torchtitan's async TP and Transformer Engine's TP
comm overlap (Megatron --tp-comm-overlap), the `tp_overlap` setting of spec/stacks.py.

Under sequence parallelism every block runs, per microbatch, an all-gather of the (b, s, h) activations before each
column-parallel input projection (q / k / v, the MLP's gate / up or fc_in) and a reduce-scatter after each
row-parallel output projection (o, down / fc_out), and their mirror images in backward (Korthikanti et al. 2022
Sec 4.2.2). Both overlap mechanisms split the collective and the GEMM into chunks and pipeline them:
- torch's micro-pipeline TP (torch/_inductor/fx_passes/micro_pipeline_tp.py @5f65158, enabled by torchtitan's
  maybe_enable_async_tp, distributed/tensor_parallel.py 16-27 @e347b1e) fuses all-gather -> matmul and
  matmul -> reduce-scatter into symmetric-memory pipelined ops;
- TE's userbuffers (Megatron initialize.py 217-246 initialize_ub) overlap the same collectives with the same GEMMs.
So each collective is hidden up to the time of the GEMMs it is paired with: forward, the projections it feeds or
drains; backward, those projections' dgrad GEMMs (whose inputs / outputs are the backward collectives). A pair
exposes max(0, collective - overlap_efficiency x GEMMs), the same efficiency the data-parallel overlap uses
(dp_sync.py: a GEMM sharing the SMs with a collective runs a little slower). MoE blocks hide only the attention's.
One pair torch does not fuse: backward's reduce-scatter of a module input's gradient when several linears read that
input (q, k, v; gate, up): their dgrads are summed before it, and micro_pipeline_tp.py's `_find_producer_matmul`
(@5f65158) fuses a reduce-scatter only of a matmul's own output, so that collective stays exposed. TE's userbuffers
run Megatron's fused linear_qkv / linear_fc1 (one dgrad each), so every pair is hidden there.
Nor does torch fuse an all-gather whose result no matmul reads: `_find_consumer_matmuls` (@5f65158) follows the
gathered tensor only into reshape -> mm / _scaled_mm. Under torchao's rowwise float8 recipe TP gathers the bf16
activations (torchtitan applies the float8 TP styles, which cast before the gather, to tensorwise only) and each
float8 linear quantizes them per row first, so the gathers stay exposed and only the forward reduce-scatters are
fused (torchtitan #866: rowwise async TP runs about as fast as vanilla TP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from backend.analytic.sharding import LocalParam
from backend.analytic.steptime.collectives import collective_s, dim_tier
from backend.analytic.steptime.compute import linear_gemms_s
from backend.analytic.steptime.hardware import Hardware
from backend.analytic.tp_placement import OUTPUT_PROJECTION
from backend.analytic.traffic import compute_bytes, is_float8_weight

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec



@dataclass(frozen=True)
class HiddenTp:
    """Seconds of TP collectives hidden per block and microbatch, forward and backward."""

    attention_fwd_s: float = 0.0
    attention_bwd_s: float = 0.0
    mlp_fwd_s: float = 0.0
    mlp_bwd_s: float = 0.0

    def per_layer(self, dense: bool) -> tuple[float, float]:
        """(forward, backward) hidden seconds of one block: a MoE block only its attention's."""
        if dense:
            return self.attention_fwd_s + self.mlp_fwd_s, self.attention_bwd_s + self.mlp_bwd_s
        return self.attention_fwd_s, self.attention_bwd_s


def _linear_s(spec: ExperimentSpec, hw: Hardware, q: LocalParam, rows: int, fp8_gemms: str) -> tuple[float, float]:
    """(forward, dgrad) seconds of one linear weight over `rows` tokens, as compute.weights_cost times them."""
    n_out, k = q.local_shape
    precision = str(spec.train.precision)
    float8 = precision == "fp8" and is_float8_weight(q)
    fwd, dgrad, _ = linear_gemms_s(hw, precision, rows, k, n_out, compute_bytes(precision), float8, fp8_gemms)
    return fwd, dgrad


def hidden_tp(spec: ExperimentSpec, hw: Hardware, params: list[LocalParam], layer: int, gpus_per_node: int,
              fp8_gemms: str = "torchao", fuses_summed_dgrads: bool = True,
              gathers_feed_matmuls: bool = True) -> HiddenTp:
    """The seconds of one block's SP collectives (module docstring) its GEMMs hide, per microbatch, on this rank
    (`layer` names the block whose local weights are paired: blocks of one kind have the same shapes);
    fuses_summed_dgrads False: torch's micro-pipeline TP, which leaves a summed input gradient's reduce-scatter
    exposed; gathers_feed_matmuls False: a cast, not a matmul, reads each gathered tensor, so no all-gather is
    fused."""
    m, t, p = spec.model, spec.train, spec.parallel
    rows = t.micro_batch * m.seq_len // p.cp
    bsh = rows * m.d_model * compute_bytes(t.precision)
    tier = dim_tier(spec, "tp", p.tp, gpus_per_node)
    gather, scatter = (collective_s(hw, tier, kind, bsh, p.tp) for kind in ("all_gather", "reduce_scatter"))
    eta = hw.tune.overlap_efficiency
    prefix = f"layers.{layer}."
    sides: dict[str, list[float]] = {"attn": [0.0, 0.0, 0.0, 0.0], "mlp": [0.0, 0.0, 0.0, 0.0]}
    readers = {"attn": 0, "mlp": 0}  # linears reading the module's input
    for q in params:
        if not q.name.startswith(prefix) or len(q.local_shape) != 2 or q.is_expert:
            continue
        local = q.name[len(prefix):]
        side = "attn" if local.startswith("attn.") else "mlp" if local.startswith("mlp.") else None
        if side is None or ".shared" in local or ".router" in local or ".gate_proj" in local:
            continue
        fwd, dgrad = _linear_s(spec, hw, q, rows, fp8_gemms)
        out = bool(OUTPUT_PROJECTION.fullmatch(q.name))  # a reduce-scatter follows it; the rest an all-gather feeds
        acc = sides[side]
        acc[2 if out else 0] += fwd
        acc[3 if out else 1] += dgrad
        readers[side] += not out

    def hide(side: str) -> tuple[float, float]:
        fin, din, fout, dout = sides[side]
        # forward: gather -> input GEMMs, output GEMM -> scatter; backward: input dgrad -> scatter, gather -> output
        # dgrad (the first unfused when several dgrads are summed before it, module docstring)
        gathered = 1.0 if gathers_feed_matmuls else 0.0
        fwd = gathered * min(gather, eta * fin) + min(scatter, eta * fout)
        input_side = min(scatter, eta * din) if fuses_summed_dgrads or readers[side] <= 1 else 0.0
        return fwd, input_side + gathered * min(gather, eta * dout)

    a, b = hide("attn"), hide("mlp")
    return HiddenTp(attention_fwd_s=a[0], attention_bwd_s=a[1], mlp_fwd_s=b[0], mlp_bwd_s=b[1])
