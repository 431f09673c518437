"""Predicted per-rank memory, communication, bubble and FLOPs of one experiment spec (pure Python).

Memory is predicted for the moment the engine compares (backend/bench/memory.py): every MemTracker /
FSDPMemTracker category when activations peak, i.e. the end of the last microbatch's forward (loss
included) = the start of backward. Category by category:
- params: this rank's parameter storage, fp32 (torch keeps fp32 parameters under autocast and FSDP2's
  MixedPrecisionPolicy), incl. FSDP2 dim-0 padding. FSDP2 zero3 (reshard_after_forward=True on every
  block AND the root) holds no unsharded copy once the root's forward ended; zero2 (reshard_after_forward=
  False) holds every local unit unsharded (padded, compute dtype). When the peak falls inside the root's
  forward (tp mixes in fp32: lm_head's logits all-gather; ep mixes: the last MoE block; non-last pipeline
  stages: the last block of the peak forward) the root (zero3), the last block (zero3, when inside it) and, when
  that forward all-gathered, the last block's flat all-gather output are alive too (backend/analytic/fsdp_state.py).
- grads: resident from the previous step (zero_grad(set_to_none=False)), fp32: DDP / ZeRO-1 one copy per
  local parameter (`.grad` are views of DDP's buckets); FSDP2 the padded sharded gradient, plus under
  pipelining the unsharded gradients accumulated by the backwards before the peak (fsdp_state.pipeline_peak).
- ddp on the dp dimension of a tp/pp/ep mix is FSDP2 `replicate` (backend/strategies/data_parallel.py): it keeps
  an unsharded copy of every parameter (2x params) and, syncing only on the last microbatch, accumulates
  unsharded gradients next to the reduced ones (when microbatches > 1; the vocab-parallel embeddings' full
  Replicate grads, sharding.unsharded_grad_numel) - measured on the fake PG.
- optimizer: AdamW m and v (8 B per owned element) + one 0-dim fp32 `step` per parameter tensor
  (torch/optim/adamw.py _init_group); SGD one momentum buffer (4 B per element). ZeRO-1: only the whole
  parameters ZeroRedundancyOptimizer assigns to this rank; FSDP2: the unpadded local shard. The update's
  own temporaries (only inside optimizer.step) are `optimizer_temp_bytes`, not part of the total.
- activations: `activations.model_layer_activation_bytes` x local layers x in-flight microbatches (PP)
  + the embedding/head term on the stages that own them, at the largest of these moments (the engine's
  "activation peak" is the Activation category's maximum over the step): end of forward + loss (16-bit
  logits: + loss_fn's transient fp32 copy); under torch.autocast (ddp / zero1 / mixes) the 16-bit weight
  copies the matmuls save, and the end of forward inside autocast (every weight and bias cast cached);
  under full recompute the last block re-run in backward after the head's backward freed its tensors.
- other: this rank's dp share of the int64 inputs and targets (`dp_slice_batch_bytes`), which the engine tracks.
Communication per rank and step: backend/analytic/traffic.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from backend.analytic import activations as A
from backend.analytic.textbook import comm as C
from backend.analytic import device as D
from backend.analytic.textbook import flops as F
from backend.analytic.textbook import pipeline as PL
from backend.analytic.textbook import zero as Z
from backend.analytic.optimizer_state import STEP_TENSOR_BYTES, _optimizer_bytes, optimizer_temp_bytes  # noqa: F401
from backend.analytic.params import count_params, model_key, param_list
from backend.analytic.fsdp_state import fsdp_peak_extra, peak_inside_forward
from backend.analytic.sharding import (LocalParam, first_short_chunk, local_params, rank_layers, rank_stages,
                                       unsharded_grad_numel, zero1_owned, zero1_owned_all)
from backend.analytic.traffic import MASTER_BYTES, compute_bytes, fsdp_param_bytes, rank_traffic, uses_replicate

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "recv")
INDEX_BYTES = 8  # int64 token ids
OTHER_IS_DP_SLICE = True
"""The engine copies only this rank's dp slice of the batch (B/dp rows) to ctx.device before the memory-tracked
step, on the CPU too (strategies/context.local_batch): `other` is that copy, not the global batch (measured on
the CPU at world 2: ddp, zero3 1,024 B = 2 x 4 x 16 x 8; tp 2,048 B = its whole dp share)."""


@dataclass
class RankEstimate:
    rank: int
    coords: dict[str, int]
    stages: list[int]
    layers: list[int]
    params_count: int
    """Parameter elements this rank owns (FSDP2: its unpadded shard)."""
    params_bytes: int = 0
    grads_bytes: int = 0
    optimizer_bytes: int = 0
    activations_bytes: int = 0
    other_bytes: int = 0
    total_bytes: int = 0
    optimizer_temp_bytes: int = 0
    """Transient bytes inside optimizer.step (not in total_bytes: the step runs after activations are freed)."""
    comm_bytes: dict[str, float] = field(default_factory=dict)
    """Payload bytes per step per collective (size of the buffers handed to it)."""
    comm_wire_bytes: dict[str, float] = field(default_factory=dict)
    """Ring-algorithm bytes sent per step per collective (comm.ring_wire_bytes, each with its group size)."""


@dataclass
class Estimate:
    per_rank: list[RankEstimate]
    params_total: int
    tokens_per_step: int
    flops_per_step: float
    bubble_fraction: float | None
    comm_bytes_per_step: dict[str, float]
    comm_wire_bytes_per_step: dict[str, float]
    zero_textbook: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _memory(spec: Any, rank: int, r: RankEstimate, params: list[LocalParam]) -> None:
    p, t = spec.parallel, spec.train
    fsdp = p.zero_stage >= 2
    dev = str(spec.runtime.device)  # resolved by estimate(): cpu or cuda
    foreach = dev == D.CUDA  # torch.optim picks foreach for CUDA tensors, single-tensor on CPU
    if fsdp:
        shards = [MASTER_BYTES * q.storage_numel for q in params]
        extra_params, extra_grads = fsdp_peak_extra(spec, params, r.stages)
        r.params_bytes = D.storage_bytes(shards, dev) + fsdp_param_bytes(spec) * extra_params  # one storage per param
        # sharded grads are views of each unit's reduce-scatter output (one storage per unit: rounding not modelled)
        r.grads_bytes = sum(shards) + MASTER_BYTES * extra_grads  # reduce_dtype fp32
        owned = params
    else:
        per_param = [MASTER_BYTES * q.local_numel for q in params]
        r.params_bytes = D.storage_bytes(per_param, dev)
        # classic DDP's `.grad` are views of its few large buckets (rounding <= 512 B per bucket, not modelled)
        r.grads_bytes = D.storage_bytes(per_param, D.CPU if _grads_in_buckets(spec) else dev)
        owned = zero1_owned(params, p.dp, p.coords(rank)["dp"]) if p.zero_stage == 1 else params
        if uses_replicate(spec):  # FSDP2 `replicate`: an unsharded copy of every parameter stays resident,
            r.params_bytes *= 2  # and without sync on earlier microbatches their unsharded grads accumulate too
            if t.microbatches > 1:  # (vocab-parallel embeddings: full Replicate grads, sharding.unsharded_grad_numel)
                r.grads_bytes += MASTER_BYTES * sum(unsharded_grad_numel(q, p.tp) for q in params)
    r.optimizer_bytes = _optimizer_bytes(owned, t.optimizer, fsdp=fsdp, device=dev)
    r.optimizer_temp_bytes = optimizer_temp_bytes(owned, t.optimizer, fsdp=fsdp, foreach=foreach)
    r.activations_bytes = A.rank_activation_bytes(spec, rank, r.layers, r.stages, params)
    r.other_bytes = (dp_slice_batch_bytes(t.global_batch // p.dp, spec.model.seq_len) if OTHER_IS_DP_SLICE
                     else input_batch_bytes(t.global_batch, spec.model.seq_len))
    r.total_bytes = r.params_bytes + r.grads_bytes + r.optimizer_bytes + r.activations_bytes + r.other_bytes


def _grads_in_buckets(spec: Any) -> bool:
    p = spec.parallel
    return p.zero_stage < 2 and p.dp > 1 and not uses_replicate(spec)


def dp_slice_batch_bytes(rows: int, seq: int) -> int:
    """This rank's dp share of (inputs, targets), each copied to its own (rows, s) int64 storage on the device."""
    return 2 * rows * seq * INDEX_BYTES


def input_batch_bytes(batch: int, seq: int) -> int:
    """Storage of the engine's int64 (inputs, targets) = tokens[:, :-1], tokens[:, 1:] (backend/engine/data.py):
    two (B, s) copies, except for B = 1 where both slices are already contiguous views of one (1, s+1) tensor."""
    return (seq + 1) * INDEX_BYTES if batch == 1 else 2 * batch * seq * INDEX_BYTES


def _estimate_rank_reference(spec: Any, rank: int) -> RankEstimate:
    """One rank computed from scratch (the definition `_all_ranks` must reproduce field for field)."""
    params = local_params(spec, rank)
    stages = rank_stages(spec, rank)
    fsdp = spec.parallel.zero_stage >= 2
    r = RankEstimate(rank=rank, coords=spec.parallel.coords(rank), stages=stages, layers=rank_layers(spec, stages),
                     params_count=sum(q.real_numel if fsdp else q.local_numel for q in params))
    _memory(spec, rank, r, params)
    for kind, payload, n in rank_traffic(spec, params, r.layers, stages):
        r.comm_bytes[kind] = r.comm_bytes.get(kind, 0.0) + payload
        r.comm_wire_bytes[kind] = r.comm_wire_bytes.get(kind, 0.0) + C.ring_wire_bytes(kind, payload, n)
    return r


def _class_key(spec: Any, c: dict[str, int], tp_first: int, dp_first: int) -> tuple[int, int, int, int]:
    """Ranks with equal keys get identical estimates (up to rank / coords and the ZeRO-1 optimizer share):
    the pp stage and ep index pick the parameters; the tp and FSDP dp indices matter only where their
    torch.chunk slice is shorter (index >= first short chunk)."""
    tp = c["tp"] if c["tp"] >= tp_first else -1
    dp = c["dp"] if spec.parallel.zero_stage >= 2 and c["dp"] >= dp_first else -1
    return c["pp"], c["ep"], tp, dp


def _short_chunk_starts(spec: Any) -> tuple[int, int]:
    """(tp, dp) index from which some parameter dim gets a shorter chunk (sharding.first_short_chunk)."""
    p = spec.parallel
    dims = {d for q in param_list(spec.model) for d in q.shape}
    tp_first = first_short_chunk(dims, p.tp)
    local = set(dims)  # dims after the tp split: full, ceil chunk, tail chunk
    for d in dims:
        rows = -(-d // p.tp) if d else 0
        local |= {rows, d - (d // rows) * rows if rows else 0}
    return tp_first, first_short_chunk(local, p.dp)


def _with_zero1_share(spec: Any, r: RankEstimate, owned: list[LocalParam]) -> None:
    t = spec.train
    dev = str(spec.runtime.device)
    r.optimizer_bytes = _optimizer_bytes(owned, t.optimizer, fsdp=False, device=dev)
    r.optimizer_temp_bytes = optimizer_temp_bytes(owned, t.optimizer, fsdp=False, foreach=dev == D.CUDA)
    r.total_bytes = r.params_bytes + r.grads_bytes + r.optimizer_bytes + r.activations_bytes + r.other_bytes


def _all_ranks(spec: Any) -> list[RankEstimate]:
    """Every rank, computed once per equivalence class (`_class_key`); ZeRO-1's per-dp-index optimizer share
    comes from one partition per class (sharding.zero1_owned_all)."""
    p = spec.parallel
    tp_first, dp_first = _short_chunk_starts(spec)
    done: dict[tuple[int, int, int, int], RankEstimate] = {}
    shares: dict[tuple[int, int, int, int], list[list[LocalParam]]] = {}
    out = []
    for rank in range(p.world_size):
        c = p.coords(rank)
        key = _class_key(spec, c, tp_first, dp_first)
        if key not in done:
            done[key] = _estimate_rank_reference(spec, rank)
            if p.zero_stage == 1:
                shares[key] = zero1_owned_all(local_params(spec, rank), p.dp)
        d = done[key]
        r = replace(d, rank=rank, coords=c, stages=list(d.stages), layers=list(d.layers),
                    comm_bytes=dict(d.comm_bytes), comm_wire_bytes=dict(d.comm_wire_bytes))
        if p.zero_stage == 1:
            _with_zero1_share(spec, r, shares[key][c["dp"]])
        out.append(r)
    return out


def matmul_params(m: Any, *, active: bool = False) -> int:
    """Weights that enter a matmul (Linear weights incl. lm_head; embeddings are lookups, biases adds)."""
    key = (model_key(m), getattr(m, "top_k", None), active)  # every field _matmul_params reads (memoised: per step)
    hit = _MATMUL.get(key)
    if hit is None:
        if len(_MATMUL) > 256:
            _MATMUL.clear()
        hit = _MATMUL[key] = _matmul_params(m, active=active)
    return hit


_MATMUL: dict[tuple, int] = {}


def _matmul_params(m: Any, *, active: bool) -> int:
    n = sum(q.numel for q in param_list(m) if len(q.shape) == 2 and not q.name.startswith(("tok_emb", "pos_emb")))
    if getattr(m, "tie_embeddings", False):
        n += m.vocab_size * m.d_model  # lm_head multiplies by the tied tok_emb weight
    if active and m.is_moe:
        mats = 3 if str(getattr(m, "mlp", "gelu")) == "swiglu" else 2
        n -= m.n_layers * (m.n_experts - m.top_k) * mats * m.d_model * getattr(m, "expert_ffn", m.ffn)  # top_k experts per token
    return n


def zero_textbook(psi: float, *, dp: int, stage: int, precision: str, optimizer: str = "adamw") -> dict[str, Any]:
    """ZeRO paper model states per device (Rajbhandari 2020 Sec 5, Fig 1) for Ψ, N = dp, K."""
    pb, gb, k = Z.precision_bytes(str(precision), str(optimizer))
    by_stage = {s: Z.zero_model_state_bytes(psi, n=dp, stage=s, k=k, param_bytes=pb, grad_bytes=gb) for s in range(4)}
    return {"psi": psi, "n": dp, "k": k, "param_bytes": pb, "grad_bytes": gb, "stage": stage,
            **by_stage[stage], "by_stage": by_stage}


def _notes(spec: Any) -> list[str]:
    p, t, notes = spec.parallel, spec.train, []
    where = peak_inside_forward(spec)  # None under pipelining
    if str(t.precision) != "fp32":
        notes.append("torch keeps fp32 params/grads/optimizer states under mixed precision (4+4+8 = 16 B/param for "
                     "AdamW); ZeRO's textbook K=12 accounting (2+2+12) is in zero_textbook")
    if p.zero_stage >= 2:
        notes.append(f"FSDP2 params at the end of forward: sharded storage{' + every unit unsharded (zero2)' if p.zero_stage == 2 else ''}; "
                     "all_gather / reduce_scatter payloads include dim-0 padding to a multiple of dp")
    if p.tp > 1:
        notes.append("TP comm: 4 (b, s, h) collectives per layer and microbatch (an SP MoE block: 2 all-gathers, no "
                     "reduce-scatter) + embedding / lm_head collectives (full logits all-gathered) + SP LayerNorm "
                     "gradient all-reduces")
    if p.pp > 1 and p.zero_stage >= 2:
        notes.append("PP x FSDP: all-gathers per unit and step = sharded->unsharded transitions (zero3 1 + "
                     "microbatches, zero2 1); unsharded gradients accumulate until the last backward (torch "
                     "pipelining/stage.py backward_maybe_with_nosync: no sync, no reshard after each backward). The "
                     "FSDP2 state at the activation peak follows the schedule's action order (fsdp_state.py): a non-last "
                     "stage peaks inside the last block of its last forward at the largest in-flight count (zero3: the "
                     "stage root and that block unsharded, + its all-gather output when that forward gathered); under "
                     "1F1B with more microbatches than the warm-up that forward follows backwards, so the stage's "
                     "unsharded gradients are held too (sharded + dp x sharded gradient bytes); where several moments "
                     "tie (few microbatches) the tracker may keep an earlier one"
                     + ("; and a rank may still hold the all-gather output of the unit it unsharded last (gloo "
                        "frees it asynchronously; seen: the embedding root on the first stage of an interleaved "
                        "schedule, + 4 B x its numel)" if p.zero_stage == 3 else ""))
    if p.zero_stage >= 2 and where == "root":
        notes.append("FSDP x TP (fp32): lm_head's logits all-gather and the loss hold the same activation bytes (to a "
                     "few bytes); the peak is predicted inside the root's forward (the last block's all-gather buffer "
                     "alive; zero3: the root unsharded), a rank whose tracker keeps the loss moment measures neither")
    if p.ep > 1:
        notes.append("EP all_to_all and MoE activations are predicted for uniform routing (incl. the 8·E-byte count "
                     "exchange); each rank's result also carries the prediction for the routing it measured "
                     "(predicted_given_routing)")
    if uses_replicate(spec) and p.tp > 1 and spec.train.microbatches > 1:
        notes.append("DDP x TP: every microbatch's forward reaches the same activation bytes (to a few bytes); the "
                     "peak is predicted at the last one, after earlier no-sync backwards accumulated unsharded "
                     "gradients; a rank whose tracker keeps the first one measures only the persistent gradients")
    if p.zero_stage >= 2 and p.ep > 1 and spec.model.is_moe and p.pp == 1 and where is None:
        notes.append("FSDP x EP: what the head and loss add after the blocks outweighs the last MoE block's dispatch "
                     "buffers (activations.ep_peaks_in_last_block), so the peak is predicted at the loss, after the "
                     "root's forward (zero3: no unsharded parameter held)")
    elif p.zero_stage >= 2 and where == "block":
        notes.append("FSDP x EP: the peak is predicted inside the last MoE block (its dispatch buffers): the root "
                     "and that block unsharded (zero3) and its all-gather buffer alive; a rank whose routed tokens "
                     "are fewer peaks at the loss instead and measures only the sharded storage")
    return notes


def estimate(spec: ExperimentSpec, *, device: str | None = None) -> Estimate:
    """Per-rank predicted memory and traffic of a validated ExperimentSpec, for ranks on `device` ("cpu" or
    "cuda"; None: spec.runtime.device, `auto` as cpu - see device.with_device)."""
    spec = D.with_device(spec, device)
    m, t, p = spec.model, spec.train, spec.parallel
    ranks = _all_ranks(spec)
    psi = count_params(m)
    kinds = sorted({k for r in ranks for k in r.comm_bytes}, key=COLLECTIVES.index)
    flops = F.training_flops_per_step(n_params_dense=matmul_params(m), tokens=spec.tokens_per_step, n_layers=m.n_layers,
                                      seq_len=m.seq_len, d_model=m.d_model, recompute=str(t.recompute),
                                      active_params=matmul_params(m, active=True) if m.is_moe else None)
    bubble = None if p.pp == 1 else PL.bubble_fraction(str(p.pp_schedule), p=p.pp, m=t.microbatches, v=p.virtual_stages)
    return Estimate(
        per_rank=ranks, params_total=psi, tokens_per_step=spec.tokens_per_step, flops_per_step=flops,
        bubble_fraction=bubble,
        comm_bytes_per_step={k: max(r.comm_bytes.get(k, 0.0) for r in ranks) for k in kinds},
        comm_wire_bytes_per_step={k: max(r.comm_wire_bytes.get(k, 0.0) for r in ranks) for k in kinds},
        zero_textbook=zero_textbook(psi, dp=p.dp, stage=p.zero_stage, precision=str(t.precision), optimizer=str(t.optimizer)),
        notes=_notes(spec) + D.device_notes(spec, n_param_tensors=len(param_list(m)),
                                            autocast=A.uses_autocast(spec)),
    )



def estimate_raw(*, params: float, dp: int, zero_stage: int, precision: str, optimizer: str = "adamw") -> dict[str, Any]:
    """Model-state bytes per device for a raw parameter count (ZeRO Sec 5): the `--params` CLI path."""
    return zero_textbook(params, dp=dp, stage=zero_stage, precision=precision, optimizer=optimizer)
