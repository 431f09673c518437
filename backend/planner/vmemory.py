"""Worst-rank memory of every layout row at once (numpy), the exact estimator's arithmetic vectorised.

`estimate._memory` per rank = params + grads + optimizer + activations + other. Every parameter-dependent term
is a sum over the rank's local parameters, and a rank holds `nb` identical blocks plus, on the first stage, the
embeddings and, on the last, the final norm and head: so each sum is nb x (one block's sum) + first x (embedding
sum) + last x (head sum), with the block/embedding/head sums taken once per (tp, dp, ep, fsdp) from
sharding.shard_param (the estimator's own sharding, at tp/dp/ep index 0: torch.chunk gives the first chunks the
most rows). ZeRO-1's largest optimizer share runs sharding.zero1_partition (zero1_owned_all's) on the rank's parameter list
(cached per rank composition). Activations follow activations.rank_activation_bytes term by term, with the
per-block / head formulas computed once per unique (micro-batch, tp, SP, recompute, autocast) by the same
functions, pipeline counts by pipeline.in_flight_formula / held_stage_*, and FSDP2's peak state by
fsdp_state (pipeline_peak / multi_stage_peak, vectorised in planner/vfsdp.py). Every pipeline rank is evaluated
(the worst one depends on the schedule). Device: the estimator's cpu reading of a spec (no 512 B rounding).
tests/test_planner_vmemory.py checks it against estimate.estimate's worst rank on 1,000 random layouts.
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import numpy as np

from backend.analytic import activations as A
from backend.analytic import estimate as E
from backend.analytic.params import block_param_list, model_key, param_tuple
from backend.analytic.textbook.pipeline import in_flight_formula
from backend.analytic.sharding import LocalParam, shard_param, unsharded_grad_numel, zero1_partition
from backend.analytic.traffic import compute_bytes
from backend.planner.space import RECOMPUTE, SCHEDULES
from backend.planner.vfsdp import fsdp_extra, unique_map

DDP_SUMS, FSDP_SUMS = ("loc", "n", "ugrad"), ("n", "sto", "real", "m_unsh", "m_ugrad")
SUMS = ("loc", "n", "sto", "real", "ugrad", "m_unsh", "m_ugrad", "w2", "bias", "head_w", "tok_w")


@lru_cache(maxsize=256)
def _part_params(mj: str, part: str, tied_copy: bool) -> list:
    m = _MODELS[mj]
    if part == "block":
        return block_param_list(m, 0)
    rest = [q for q in param_tuple(model_key(m)) if not q.name.startswith("layers.")]
    first = [q for q in rest if q.name.split(".")[0] in ("tok_emb", "pos_emb")]
    if part == "first":
        return first
    last = [q for q in rest if q not in first]
    if tied_copy:  # sharding._pp_params: the last stage's own copy of the tied word embedding
        last.append(type(rest[0])("lm_head.weight", (m.vocab_size, m.d_model)))
    return last


@lru_cache(maxsize=4096)
def _local(mj: str, part: str, tp: int, dp: int, ep: int, fsdp: bool, tied_copy: bool) -> tuple[LocalParam, ...]:
    m = _MODELS[mj]
    out = (shard_param(q, n_experts=m.n_experts, tp=tp, dp=dp, ep=ep, tp_rank=0, dp_rank=0, ep_rank=0, fsdp=fsdp)
           for q in _part_params(mj, part, tied_copy))
    return tuple(q for q in out if q is not None)


@lru_cache(maxsize=4096)
def _sums(mj: str, part: str, tp: int, dp: int, ep: int, fsdp: bool, tied_copy: bool) -> tuple[float, ...]:
    """The SUMS of one part's local parameters (estimate._memory / fsdp_state / activations.autocast_copy_bytes)."""
    out = [0] * len(SUMS)
    for q in _local(mj, part, tp, dp, ep, fsdp, tied_copy):
        loc, ugrad, name = q.local_numel, unsharded_grad_numel(q, tp), q.name
        out[0] += loc
        out[1] += 1
        out[2] += q.storage_numel
        out[3] += q.real_numel
        out[4] += ugrad
        if not (q.is_expert and ep > 1):  # ep experts are FSDP2 ignored_params
            out[5] += q.storage_numel * q.dp_group
            out[6] += ugrad
        if name.startswith("layers."):
            out[7] += loc if len(q.shape) == 2 else 0
            out[8] += loc if name.endswith(".bias") and ".ln" not in name else 0
        out[9] += loc if name.startswith("lm_head.") else 0
        out[10] += loc if name == "tok_emb.weight" else 0
    return tuple(out)


_MODELS: dict[str, Any] = {}


@lru_cache(maxsize=4096)
def _numels(mj: str, part: str, tp: int, ep: int, tied_copy: bool) -> tuple[int, ...]:
    """`local_numel` (a product, computed on every read) of one part's unsharded-by-dp parameters, once."""
    return tuple(q.local_numel for q in _local(mj, part, tp, 1, ep, False, tied_copy))


@lru_cache(maxsize=8192)
def _zero1_worst(mj: str, tp: int, dp: int, ep: int, nb: int, first: bool, last: bool, tied_copy: bool, opt: str) -> int:
    """Largest ZeRO-1 optimizer share of a rank holding nb blocks (+ embeddings / head): zero1_owned_all's partition.
    Among the shares with the most elements, the optimizer's own formula is evaluated once per distinct tensor count
    (equal-element shares differ only in their per-tensor terms)."""
    numels = list(_numels(mj, "block", tp, ep, False)) * nb + list(_numels(mj, "first", tp, ep, False)) * first
    numels += list(_numels(mj, "last", tp, ep, tied_copy)) * last
    owner = zero1_partition(numels, dp)  # zero1_owned_all's partition, without building every share's list
    own = np.asarray(owner, dtype=np.int64)
    elems = np.bincount(own, weights=np.asarray(numels, dtype=np.float64), minlength=dp)  # < 2^53: exact
    count = np.bincount(own, minlength=dp)
    tops = np.nonzero(elems == elems.max())[0].tolist()  # the largest shares; the optimizer's formula picks among them
    picks = {int(count[k]): k for k in tops}.values()
    params = list(_local(mj, "block", tp, 1, ep, False, False)) * nb + list(_local(mj, "first", tp, 1, ep, False, False)) * first
    params += list(_local(mj, "last", tp, 1, ep, False, tied_copy)) * last
    return max(E._optimizer_bytes([q for q, o in zip(params, owner) if o == k], opt, fsdp=False) for k in picks)


def _ns(m: Any, *, tp=1, pp=1, dp=1, ep=1, zero=0, b=1, rc=0, sp=0, sched=0, v=1, mb=1, gb=1, precision="bf16-mixed"):
    """A spec-shaped namespace for the analytic functions that read a spec (no validation: rows are valid)."""
    par = SimpleNamespace(tp=tp, pp=pp, dp=dp, ep=ep, zero_stage=zero, sequence_parallel=bool(sp),
                          pp_schedule=SCHEDULES[sched], virtual_stages=v, world_size=tp * pp * dp)
    train = SimpleNamespace(micro_batch=b, recompute=RECOMPUTE[rc], precision=precision, microbatches=mb, global_batch=gb)
    return SimpleNamespace(model=m, parallel=par, train=train, runtime=SimpleNamespace(device="cpu"))


@lru_cache(maxsize=8192)
def _row_terms(mj: str, b: int, tp: int, sp: int, rc: int, ac: bool, ep: int, precision: str) -> tuple[float, ...]:
    """(block bytes at rc, block none - block full, embedding+head at end of forward, head freed in backward,
    TP logits shard) from activations.py's own functions."""
    m = _MODELS[mj]
    spec = _ns(m, tp=tp, ep=ep, b=b, rc=rc, sp=sp, zero=0 if ac else 3, precision=precision)  # zero: uses_autocast = ac
    kw = A._layer_kwargs(spec)
    assert kw["autocast"] == ac
    hkw = dict(s=m.seq_len, b=b, h=m.d_model, vocab=m.vocab_size, dtype_bytes=kw["dtype_bytes"], t=tp,
               autocast=ac, norm=kw["norm"], learned_pos=not kw["rope"])
    layer = A.model_layer_activation_bytes(**{**kw, "recompute": RECOMPUTE[rc]})
    extra = (A.model_layer_activation_bytes(**{**kw, "recompute": "none"})
             - A.model_layer_activation_bytes(**{**kw, "recompute": "full"}))
    return (layer, extra, A.model_embedding_head_activation_bytes(**hkw), A.model_head_freed_in_backward_bytes(**hkw),
            A._tp_logits_shard_bytes(spec, kw["dtype_bytes"]))


def worst_rank_bytes_v(model: Any, L: np.ndarray, *, global_batch: int, precision: str = "bf16-mixed",
                       optimizer: str = "adamw") -> tuple[np.ndarray, np.ndarray]:
    """(worst-rank total bytes, its pipeline index) per layout row of L (space.COLUMNS), as estimate.estimate."""
    mj = model.model_dump_json()
    _MODELS[mj] = model
    worst, where = np.zeros(len(L)), np.zeros(len(L), dtype=np.int64)
    for pp in np.unique(L[:, 1]).tolist():  # one (rows, pp) array per pipeline degree and dp family
        for fsdp in (False, True):
            idx = np.nonzero((L[:, 1] == pp) & ((L[:, 4] >= 2) == fsdp))[0]
            if len(idx):
                tot = _block(model, mj, L[idx], pp, fsdp, global_batch, precision, optimizer)
                where[idx] = tot.argmax(axis=1)
                worst[idx] = tot[np.arange(len(idx)), where[idx]]
    return worst, where


def _block(m: Any, mj: str, R: np.ndarray, pp: int, fsdp: bool, gb: int, precision: str, opt: str) -> np.ndarray:
    """(rows, pp) total bytes of every pipeline rank (tp / dp / ep index 0) of rows sharing pp and FSDP (zero >= 2)
    or not."""
    col = lambda i: R[:, i:i + 1]  # noqa: E731  (n, 1) so it broadcasts against ranks (1, pp)
    tp, dp = col(0), col(2)
    ep, zero, b, rc, sched, v, sp = (col(i) for i in range(3, 10))
    r = np.arange(pp)[None, :]
    mb = gb // (b * dp)
    s, cb = m.seq_len, compute_bytes(precision)
    tie, lp = bool(getattr(m, "tie_embeddings", False)), str(getattr(m, "positions", "learned")) == "learned"
    mix = (tp > 1) | (pp > 1) | (ep > 1)
    ac = (precision != "fp32") & (mix if fsdp else np.ones_like(mix))  # activations.uses_autocast
    # pipeline position of every rank (sharding.stages_of_rank / layer_split)
    zbv = sched == 4
    n_st = pp * v
    base, extra = m.n_layers // n_st, m.n_layers % n_st  # sharding.layer_split: earlier stages get one more
    looped = sum(np.where(k < v, base + (r + k * pp < extra), 0) for k in range(int(v.max())))
    nb = np.where(zbv, 2 * base + (r < extra) + (2 * pp - 1 - r < extra), looped)
    first = r == 0
    last = np.where(zbv, r == 0, r == pp - 1)
    # parameter sums: nb blocks + embeddings (first stage) + norm / head (last stage)
    parts = unique_map(lambda t, d, e, f: sum((_sums(mj, part, t, d, e, bool(f), tie and pp > 1 and part == "last")
                                                for part in ("block", "first", "last")), ()),
                        [tp, dp, ep, np.full(len(R), int(fsdp))])
    k = len(SUMS)
    S = {name: nb * parts[:, j:j + 1] + first * parts[:, k + j:k + j + 1] + last * parts[:, 2 * k + j:2 * k + j + 1]
         for j, name in enumerate(SUMS) if name in (FSDP_SUMS if fsdp else DDP_SUMS)}
    B = {name: parts[:, j:j + 1] for j, name in enumerate(SUMS)}  # one block
    F = {name: parts[:, k + j:k + j + 1] for j, name in enumerate(SUMS)}
    La = {name: parts[:, 2 * k + j:2 * k + j + 1] for j, name in enumerate(SUMS)}
    adamw = opt == "adamw"
    act = _activations(m, mj, R, B, F, La, nb, first, last, r, mb, ac, tp, pp, cb, precision, tie, lp)
    other = (E.dp_slice_batch_bytes(gb // dp, s) if E.OTHER_IS_DP_SLICE else E.input_batch_bytes(gb, s))
    if fsdp:  # FSDP2 (zero2 / zero3): sharded storage + the unsharded state at the peak (fsdp_state.fsdp_peak_extra)
        xp, xg = fsdp_extra(m, S, B, F, La, zero, sched, v, mb, ep, r, first, last, tp, pp, cb, b, sp, ac)
        params = 4 * S["sto"] + np.where(mix, 4, cb) * xp  # traffic.fsdp_param_bytes
        grads = 4 * S["sto"] + 4 * xg
        optim = (8 * S["real"] + 4 * S["n"]) if adamw else 4 * S["real"]
        return params + grads + optim + act + other
    # DDP / ZeRO-1 / FSDP2 replicate (estimate._memory)
    rep = (zero == 0) & (dp > 1) & ((tp > 1) | (pp > 1))  # traffic.uses_replicate
    params = 4 * S["loc"] * np.where(rep, 2, 1)
    grads = 4 * S["loc"] + np.where(rep & (mb > 1), 4 * S["ugrad"], 0)
    optim = (8 * S["loc"] + 4 * S["n"]) if adamw else 4 * S["loc"]
    z1 = np.nonzero((R[:, 4] == 1) & (R[:, 2] > 1))[0]
    if len(z1):
        sub = lambda a: np.broadcast_to(a, nb.shape)[z1].ravel()  # noqa: E731
        vals = unique_map(lambda t, d, e, n, f, la: _zero1_worst(mj, t, d, e, n, bool(f), bool(la), tie and pp > 1, opt),
                           [sub(tp), sub(dp), sub(ep), sub(nb), sub(first), sub(last)])
        optim = np.broadcast_to(optim, nb.shape).copy()
        optim[z1] = vals.reshape(len(z1), pp)
    return params + grads + optim + act + other


def _pipeline_saved(sched: str, pp, r, nb, first, last, mb, v, L1, head_shard, ac, sp, tp, b, m, cb, lp):
    """activations._pipeline_saved for the rows of one schedule: in-flight chunks, held stage inputs / outputs,
    positions, and on the last stage the head's saved tensors per in-flight loss and the loss scalars."""
    s, h = m.seq_len, m.d_model
    units = in_flight_formula(sched, p=pp, m=mb, stage=r, v=v)
    buf = b * s * h / np.where(sp == 1, tp, 1) * np.where(ac, 4, cb)  # one stage input / output
    n_nonfirst = v - first
    senders = v - last - ((sched == "zbv") & (r == pp - 1))  # pipeline.held_stage_outputs
    out = {"gpipe": mb, "1f1b": np.minimum(mb, units + 1)}.get(sched, mb * senders)
    held_out = np.where(senders == 0, 0, out)
    total = units * (nb * L1 / v - buf * n_nonfirst / v + first * (lp * s * A.INDEX_BYTES) / v)
    total += buf * (mb * n_nonfirst + held_out)
    k_last = mb if sched == "gpipe" else 1  # pipeline.last_stage_in_flight
    head = head_shard - (s * A.INDEX_BYTES * lp + A.LOSS_BYTES)
    return total + last * (k_last * head + 4 * (mb + k_last + 1))


def _activations(m, mj, R, B, F, La, nb, first, last, r, mb, ac, tp, pp, cb, precision, tie, lp):
    """activations.rank_activation_bytes for every (row, pipeline rank)."""
    col = lambda i: R[:, i:i + 1]  # noqa: E731
    b, rc, sched, v, sp, ep = col(5), col(6), col(7), col(8), col(9), col(3)
    terms = unique_map(lambda t, bb, s_, rr, a, e: _row_terms(mj, bb, t, s_, rr, bool(a), e, precision),
                        [tp, b, sp, rc, ac, ep])
    L1, Lx, Hf, Hfr, shard = (terms[:, j:j + 1] for j in range(5))
    s, h, V = m.seq_len, m.d_model, m.vocab_size
    if pp == 1:
        total = nb * L1 + (Hf + shard)
        head_freed, fwd_tr = Hfr, 0.0
    else:
        total = np.empty(nb.shape)
        for k in np.unique(sched).tolist():
            rows = sched[:, 0] == k
            total[rows] = _pipeline_saved(SCHEDULES[k], pp, r, nb[rows], first, last[rows], mb[rows], v[rows],
                                          L1[rows], Hf[rows] + shard[rows], ac[rows], sp[rows], tp[rows],
                                          b[rows], m, cb, lp)
        head_freed = last * Hfr
        fwd_tr = b * s * h / np.where(sp == 1, tp, 1) * cb
    wcast = ac * cb * B["w2"]  # (n, 1): one block's autocast weight / bias casts (activations.autocast_copy_bytes)
    bcast = ac * cb * B["bias"]
    wb = nb * wcast
    wbb = nb * (wcast + bcast)
    wh = ac * cb * (last * La["head_w"] + (tie and pp == 1) * F["tok_w"])
    full = rc == 2
    sbv = s * b * V
    fwd_last = total + wh + np.where(full, 0, wb) + (0 if cb == 4 else 1) * sbv * 4
    if ac.any():
        alt = total + wh + wbb + ((mb > 1) * sbv * cb - sbv * 4 - A.LOSS_BYTES)
        fwd_last = np.where(ac, np.maximum(fwd_last, alt), fwd_last)
    fwd = np.where(last, fwd_last, total + wbb + fwd_tr)
    use_rec = full & ~((pp > 1) & ((sched == 3) | (sched == 4)))
    if not use_rec.any():
        return np.rint(fwd)
    rec = total + np.maximum(0, Lx - head_freed) + (wcast + bcast)
    return np.rint(np.where(use_rec, np.maximum(fwd, rec), fwd))
