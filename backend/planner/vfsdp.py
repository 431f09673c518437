"""FSDP2's unsharded state at the activation peak for every (layout, pipeline rank), vectorised
(fsdp_state.fsdp_peak_extra / pipeline_peak / multi_stage_peak), for planner/vmemory.py."""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from backend.analytic import activations as A
from backend.analytic.sharding import layer_split


def unique_map(fn, cols: list[np.ndarray]) -> np.ndarray:
    """fn(*row) for every row of the stacked non-negative int columns, evaluated once per distinct row (one
    mixed-radix int64 key per row: np.unique(axis=0) sorts void rows ~50x slower). Returns (n, k) floats."""
    cols = [np.asarray(c, dtype=np.int64).ravel() for c in cols]
    key = np.zeros(len(cols[0]), dtype=np.int64)
    for c in cols:
        key = key * (int(c.max()) + 1) + c
    _, first, inv = np.unique(key, return_index=True, return_inverse=True)
    rows = np.stack([c[first] for c in cols], axis=1).tolist()  # python ints, one list per distinct row
    vals = np.array([fn(*row) for row in rows], dtype=np.float64).reshape(len(first), -1)
    return vals[inv.ravel()]


def _last_in(upper: int, per_round: int, v: int, chunk: int) -> int:
    """The largest i <= upper with (i // per_round) % v == chunk, -1 if none."""
    if upper < 0:
        return -1
    q = upper // per_round
    q2 = q - (q - chunk) % v
    return -1 if q2 < 0 else upper if q2 == q else q2 * per_round + per_round - 1


def interleaved_peak_states(p: int, v: int, m: int, rank: int, zero: int = 3) -> dict[int, tuple[bool, bool, bool, bool]]:
    """fsdp_state.multi_stage_peak's {stage: (unsharded, grads, in_forward, gathered)} in closed form (tests: equal
    on a grid). In fsdp_state.interleaved_order the peak is always the rank's last forward (op m·v - 1: the
    in-flight count is warm-up + 1 at every steady-state forward, the warm-up's at its last); before it run every
    earlier forward and the backwards of steady ops warm-up .. m·v - 2. A stage is unsharded when its latest action
    is a backward. The peak forward's stage, unless it is the last stage, is inside that forward: zero3 gathered
    unless a backward left its units unsharded, zero2 only if it is the stage's first action."""
    per_round = m // max(1, m // p)
    warm = min((v - 1) * per_round + 2 * (p - 1 - rank), m * v)
    steady, peak = m * v - warm, m * v - 1
    at = (peak // per_round) % v
    with_peak = at == v - 1 and rank == p - 1  # the last stage counts after its forward
    pos_f = lambda i: i if i < warm else 2 * i - warm  # noqa: E731  position in the action list
    out = {}
    for c in range(v):
        f = _last_in(peak if with_peak else peak - 1, per_round, v, c)
        jb = _last_in(steady - 2, per_round, v, v - 1 - c)
        b = warm + jb if jb >= 0 else -1
        unsh = b >= 0 and (f < 0 or 2 * b - warm + 1 > pos_f(f))
        if c == at and not with_peak:
            out[c * p + rank] = (False, b >= 0, True, (f < 0 and b < 0) if zero == 2 else not unsh)
        else:
            out[c * p + rank] = (unsh, b >= 0, False, False)
    return out


@lru_cache(maxsize=65536)
def _multi_stage(pp: int, v: int, mb: int, zero: int, rank: int, n_layers: int) -> tuple[int, ...]:
    """Interleaved FSDP2 state (fsdp_state.multi_stage_peak / fsdp_peak_extra) of one pipeline rank as (blocks
    unsharded, root unsharded, blocks with grads, embeddings with grads, head with grads, extra unsharded blocks
    and extra embedding roots of the peak forward's stage: forward_peak_numel)."""
    st = interleaved_peak_states(pp, v, mb, rank, zero)
    stages = sorted(st)
    split = layer_split(n_layers, pp * v)
    last = pp * v - 1
    root = 0 if 0 in stages else last if last in stages else None
    fwd = [s for s in stages if st[s][2]]
    z3 = zero != 2
    fwd_blocks = sum(int(st[s][3]) + z3 for s in fwd if len(split[s]))  # its all-gather output + (zero3) the block
    fwd_root = sum(z3 for s in fwd if s == 0)  # zero3: the stage root (embeddings; never the last stage here)
    return (sum(len(split[s]) for s in stages if st[s][0]), root is not None and st[root][0],
            sum(len(split[s]) for s in stages if st[s][1]), 0 in stages and st[0][1],
            last in stages and st[last][1], fwd_blocks, fwd_root)


def _pipeline_peak(sched, zero, mb, r, pp, head_block, head_root):
    """fsdp_state.pipeline_peak (gpipe / 1f1b, one stage per rank) as (where "block", where "root", gathered,
    after_backward) boolean arrays; False everywhere for other schedules."""
    pipe = ((sched == 0) | (sched == 1)) & (zero >= 2)
    lastr = r == pp - 1
    z2 = zero == 2
    after_l = (sched == 0) & (mb > 1)
    where_l = head_block | head_root
    gathered_l = where_l & np.where(z2, mb == 1, ~after_l)
    warm = np.where(sched == 1, mb, np.minimum(mb, pp - r))
    steady = (sched == 0) & (mb > warm)
    first = ~steady & (warm == 1)
    block = pipe & np.where(lastr, head_block, np.where(z2, first, True))
    root = pipe & lastr & head_root
    gathered = pipe & np.where(lastr, gathered_l, np.where(z2, first, ~steady))
    after = pipe & np.where(lastr, after_l, steady)
    return block, root, gathered, after


def _ep_block(m, ep, b, tp, sp, ac, cb, shape):
    """fsdp_state._head_peak's ep rule per row: the last MoE block's dispatch outweighs the head and loss
    (activations.ep_peaks_in_last_block, evaluated once per distinct (b, tp, sp, autocast))."""
    out = np.zeros(shape, dtype=bool)
    rows = np.nonzero(np.broadcast_to(ep > 1, shape)[:, 0])[0] if m.is_moe else []
    if len(rows):
        fam = A.family_kwargs(m)
        col = lambda a: np.broadcast_to(a, shape)[rows, 0]  # noqa: E731

        def wins(bb: int, t: int, q: int, a: int) -> bool:
            head = A.head_beyond_blocks_bytes(s=m.seq_len, b=bb, h=m.d_model, vocab=m.vocab_size, dtype_bytes=cb, t=t,
                                              sp=bool(q), autocast=bool(a), norm=fam["norm"], learned_pos=not fam["rope"])
            return A.ep_dispatch_peak_bytes(s=m.seq_len, b=bb, h=m.d_model, n_experts=m.n_experts, top_k=m.top_k,
                                            dtype_bytes=cb, autocast=bool(a)) > head

        out[rows] = unique_map(wins, [col(b), col(tp), col(sp), col(ac)]) > 0
    return out


def fsdp_extra(m, S, B, F, La, zero, sched, v, mb, ep, r, first, last, tp, pp, cb, b, sp, ac):
    """(unsharded parameter elements, unsharded gradient elements) beyond the FSDP2 shards: fsdp_peak_extra."""
    shape = np.broadcast(zero, r).shape
    xp = np.where(zero == 2, S["m_unsh"], 0.0) * np.ones(shape)
    xg = np.zeros(shape)
    root_unsh = first * F["m_unsh"] + last * La["m_unsh"]
    head_block = _ep_block(m, ep, b, tp, sp, ac, cb, shape)  # fsdp_state._head_peak
    head_root = ~head_block & (tp > 1) & (cb == 4)
    if pp > 1:
        inter = (sched == 2) & (v >= 2) & (zero >= 2)  # interleaved ranks: per local stage (multi_stage_peak)
        rows = np.nonzero(inter[:, 0])[0]
        if len(rows):
            rr = np.broadcast_to(r, (len(rows), pp)).ravel()
            rep = lambda a: np.broadcast_to(a[rows], (len(rows), pp)).ravel()  # noqa: E731
            st = unique_map(lambda vv, mm, z, k: _multi_stage(pp, vv, mm, z, k, m.n_layers),
                            [rep(v), rep(mb), rep(zero), rr]).reshape(len(rows), pp, 7)
            nbu, rootu, nbg, embg, headg, fwdb, fwdr = (st[..., j] for j in range(7))
            z3 = zero[rows] == 3
            fwd = fwdb * B["m_unsh"][rows] + fwdr * F["m_unsh"][rows]
            xp[rows] = np.where(z3, nbu * B["m_unsh"][rows] + rootu * root_unsh[rows], xp[rows]) + fwd
            xg[rows] = nbg * B["m_ugrad"][rows] + embg * F["m_ugrad"][rows] + headg * La["m_ugrad"][rows]
        block, in_root, gathered, after = _pipeline_peak(sched, zero, mb, r, pp, head_block, head_root)
    else:  # fsdp_state.peak_inside_forward: every microbatch's forward all-gathers
        block, in_root = head_block, head_root
        gathered, after = (block | in_root), np.zeros(shape, dtype=bool)
    xg = np.where(after, S["m_ugrad"], xg)
    inside = (in_root | block) & (zero >= 2)
    xp = xp + np.where(inside & gathered, B["m_unsh"], 0.0)  # the last block's all-gather output
    xp = xp + np.where(inside & (zero == 3), root_unsh + np.where(block, B["m_unsh"], 0.0), 0.0)
    return xp, xg
