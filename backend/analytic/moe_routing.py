"""Expert-parallel all-to-all payload and MoE activation bytes for a GIVEN routing (pure Python).

The analytic model (traffic.py, activations.py) assumes uniform routing: every ep rank's experts receive
N·k token-slots per MoE layer and microbatch (N tokens, top-k). Real routing is data-dependent, so here the
same two quantities are computed from measured token counts (backend/strategies/moe_dispatch.RoutingLog):
per dispatch call, S rows sent by this rank (always N·k: droppless, no capacity factor) and R rows its
experts received from the ep group. With R = N·k the all-to-all payload is exactly traffic.py's uniform value
and the activation term is the one activations.py uses for ep > 1 (`ep_moe_layer_bytes`): the dense-dispatch
MoE term plus what only the all-to-all dispatch saves (`ep_only_uniform_bytes`: the expert outputs index_add
keeps, the sort-order index), both tested.

Sources: Lepikhin et al. 2021, GShard, Sec 3.1 / Algorithm 2 (dispatch and combine as AllToAll, forward and
backward); Fedus et al. 2022, Switch Transformer, Sec 2.2 (each expert's computation scales with the tokens
routed to it: "expert capacity"; here unbounded, every routed token is kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backend.analytic.traffic import compute_bytes

COUNT_BYTES = 8  # moe_dispatch exchanges E int64 counts before the rows
INDEX_BYTES = 8  # int64 indices autograd saves (as activations.INDEX_BYTES; not imported: activations may import this)


@dataclass(frozen=True)
class Dispatch:
    """One MoE layer's dispatch on one rank for one microbatch (a RoutingLog record)."""
    microbatch: int
    layer: str
    sent: list[int]
    """Rows (token-slots) this rank sent to each of the E experts."""
    received: list[list[int]]
    """Rows each ep peer s sent to this rank's local expert j: received[s][j]."""
    recompute: bool = False
    """A forward re-run by activation checkpointing (its all-to-alls happen again, nothing more is saved)."""

    @property
    def sent_rows(self) -> int:
        return sum(self.sent)

    @property
    def received_rows(self) -> int:
        return sum(map(sum, self.received))


def dispatches(routing: dict[str, Any]) -> list[Dispatch]:
    """The ep strategy's payload entry (backend/strategies/ep.routing_payload) as Dispatch records."""
    return [Dispatch(microbatch=r["microbatch"], layer=str(r["layer"]), sent=list(r["sent"]),
                     received=[list(x) for x in r["received"]], recompute=bool(r.get("recompute", False)))
            for r in routing["records"]]


def uniform_like(ds: list[Dispatch], *, tokens: int, top_k: int, n_experts: int, ep: int) -> list[Dispatch]:
    """The same calls under uniform routing: N·k/E rows to every expert, N·k/E from every peer to each local one."""
    per = tokens * top_k / n_experts
    n_local = n_experts // ep
    return [Dispatch(d.microbatch, d.layer, [per] * n_experts, [[per] * n_local for _ in range(ep)], d.recompute)
            for d in ds]


def all_to_all_call_bytes(d: Dispatch, *, h: int, dtype_bytes: float, n_experts: int) -> float:
    """all_to_all payload (input buffers, as backend/bench/comm.py counts) of one dispatch call on this rank;
    dtype_bytes: of the routed rows (`row_bytes`)."""
    row = h * dtype_bytes
    # GShard Alg. 2: the E counts, then dispatch (S rows leave) and combine (R rows go back)
    fwd = COUNT_BYTES * n_experts + (d.sent_rows + d.received_rows) * row
    if d.recompute:
        return fwd
    return fwd + (d.sent_rows + d.received_rows) * row  # GShard Sec 3.1: backward runs both transposed (S and R)


def all_to_all_bytes(ds: list[Dispatch], *, h: int, dtype_bytes: float, n_experts: int) -> float:
    """all_to_all payload of a step on this rank: sum over its dispatch calls."""
    return sum(all_to_all_call_bytes(d, h=h, dtype_bytes=dtype_bytes, n_experts=n_experts) for d in ds)


def row_bytes(dtype_bytes: float, autocast: bool) -> float:
    """Bytes per element of the routed rows and of every MoE tensor outside the expert Linears: under torch.autocast
    the ln2 output they come from is fp32 (layer_norm and softmax are on autocast's fp32 op list) and the expert
    outputs are cast back to it (moe_dispatch, like the dense MoE)."""
    return 4 if autocast else dtype_bytes


def moe_sender_bytes(*, tokens: int, h: int, n_experts: int, top_k: int, dtype_bytes: float,
                     autocast: bool = False) -> float:
    """Saved bytes of one EP MoE layer that scale with this rank's OWN N tokens (rows = N·k), read off
    moe_dispatch.all_to_all_dispatch: router softmax (N, E); top-k values (N, k) and their sum (N, 1); the
    combine's mul operands, returned rows (rows, h) and weights (rows, 1), and index_add's source (rows, h);
    int64 indices: top-k ids, the sort order and the token of each sorted slot (rows each)."""
    rows = tokens * top_k
    elems = tokens * n_experts + rows + tokens + (rows * h + rows) + rows * h
    return elems * row_bytes(dtype_bytes, autocast) + 3 * rows * INDEX_BYTES


def moe_expert_bytes(*, received_rows: float, h: int, ffn: int, dtype_bytes: float, autocast: bool = False,
                     swiglu: bool = False) -> float:
    """Saved bytes of one EP MoE layer's LOCAL experts, which scale with the R rows they received (Switch Sec 2.2):
    fc_in input (R, h; its 16-bit cast under autocast), GELU input and fc_out input (R, ffn) each, index_add's
    source = expert output (R, h, in the row dtype); the int64 row index per local expert (one tensor, saved by
    x[rows] and index_add alike)."""
    # SwiGLU experts: gate out, silu out, up out and their product instead of GELU in / out (4 (R, ffn) tensors)
    linear = (received_rows * h + (4 if swiglu else 2) * received_rows * ffn) * dtype_bytes
    return linear + received_rows * h * row_bytes(dtype_bytes, autocast) + received_rows * INDEX_BYTES


def ep_moe_layer_bytes(*, tokens: int, received_rows: float, h: int, ffn: int, n_experts: int, top_k: int,
                       dtype_bytes: float, autocast: bool = False, swiglu: bool = False) -> float:
    """One MoE layer's saved bytes on an ep rank whose experts received `received_rows` token-slots.
    With received_rows = N·k this is activations._moe_bytes (the dense dispatch) + N·k·h·dtype_bytes (the
    expert output index_add keeps: the dense path keeps its weighted product instead, counted already) + N·k
    int64 (the sort order): see `ep_only_uniform_bytes` (without autocast)."""
    return (moe_sender_bytes(tokens=tokens, h=h, n_experts=n_experts, top_k=top_k, dtype_bytes=dtype_bytes,
                             autocast=autocast)
            + moe_expert_bytes(received_rows=received_rows, h=h, ffn=ffn, dtype_bytes=dtype_bytes, autocast=autocast,
                               swiglu=swiglu))


def predicted_moe_layer_bytes(spec: Any) -> float:
    """The MoE term inside the uniform prediction's per-layer bytes: activations.model_layer_activation_bytes with
    experts minus without (+ the dense MLP term that replaces them), so a change of that model is followed here.
    For ep > 1 it is `ep_moe_layer_bytes` at uniform counts."""
    from backend.analytic import activations as A

    kw, rc = A._layer_kwargs(spec), str(spec.train.recompute)
    kw = kw | {"shared_ffn": 0}  # the shared experts are dense: not part of the routed term
    with_experts = A.model_layer_activation_bytes(recompute=rc, **kw)
    dense = A.model_layer_activation_bytes(recompute=rc, **(kw | {"n_experts": 0}))
    mlp = A._mlp_elems(s=kw["s"], b=kw["b"], h=kw["h"], ffn=kw["ffn"], t=kw["t"], swiglu=kw["mlp"] == "swiglu") * kw["dtype_bytes"]
    return with_experts - dense + mlp


def ep_only_uniform_bytes(*, tokens: int, h: int, top_k: int, dtype_bytes: float) -> float:
    """What the all-to-all dispatch saves beyond the dense one per layer under uniform routing (see above)."""
    return tokens * top_k * (h * dtype_bytes + INDEX_BYTES)


def peak_microbatch(ds: list[Dispatch], **kw: Any) -> tuple[float, int, int | None]:
    """(largest EP MoE saved bytes of any one microbatch, its MoE layer count, that microbatch): a microbatch's
    saved tensors are freed by its backward before the next one starts, so the activation peak falls in the
    heaviest one. kw: tokens, h, ffn, n_experts, top_k, dtype_bytes, autocast."""
    per_mb: dict[int, list[float]] = {}
    for d in ds:
        if not d.recompute:
            per_mb.setdefault(d.microbatch, []).append(ep_moe_layer_bytes(received_rows=d.received_rows, **kw))
    if not per_mb:
        return 0.0, 0, None
    mb = max(per_mb, key=lambda k: sum(per_mb[k]))
    return sum(per_mb[mb]), len(per_mb[mb]), mb


@dataclass(frozen=True)
class RoutingAdjustment:
    """One rank's step under its measured routing, next to the uniform prediction."""
    all_to_all_bytes: float
    """all_to_all payload of every recorded dispatch (the only all_to_all an ep rank runs)."""
    activations_delta_bytes: float
    """EP MoE terms at the measured counts of the heaviest microbatch minus the MoE terms the uniform prediction
    holds (`predicted_moe_layer_bytes`; 0 for uniform counts)."""
    received_slots: int
    """Token-slots this rank's experts received over the step (every layer and microbatch, recomputes excluded)."""
    uniform_slots: float
    peak_microbatch: int | None

    @property
    def load(self) -> float:
        return self.received_slots / self.uniform_slots if self.uniform_slots else 0.0


def adjustment(spec: Any, routing: dict[str, Any]) -> RoutingAdjustment:
    """This rank's all_to_all payload and MoE activation bytes for its measured routing, with the EP dispatch's
    own saved tensors and row dtype. Full recompute keeps no MoE tensors across the step: no activation
    adjustment then."""
    from backend.analytic.activations import uses_autocast

    m, t = spec.model, spec.train
    cb, ac = compute_bytes(t.precision), uses_autocast(spec)
    ds = dispatches(routing)
    n, k, e = routing["tokens"], routing["top_k"], routing["n_experts"]
    a2a = all_to_all_bytes(ds, h=m.d_model, dtype_bytes=row_bytes(cb, ac), n_experts=e)
    layer_kw = dict(tokens=n, h=m.d_model, ffn=m.expert_ffn, n_experts=e, top_k=k, dtype_bytes=cb, autocast=ac,
                    swiglu=str(m.mlp) == "swiglu")
    measured, n_layers, mb = peak_microbatch(ds, **layer_kw)
    act = 0.0 if str(t.recompute) == "full" else measured - n_layers * predicted_moe_layer_bytes(spec)
    first = [d for d in ds if not d.recompute]
    uniform = len(first) * n * k  # droppless: every rank's experts get N·k slots per layer and microbatch on average
    return RoutingAdjustment(all_to_all_bytes=a2a, activations_delta_bytes=act,
                             received_slots=sum(d.received_rows for d in first), uniform_slots=uniform,
                             peak_microbatch=mb)
