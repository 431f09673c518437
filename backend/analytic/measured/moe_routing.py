"""Expert-parallel all-to-all payload and MoE activation bytes for a MEASURED routing (post-processing of a run).

The analytic model (traffic.py, memory/activations.py) assumes uniform routing: every ep rank's experts receive
N·k token-slots per MoE layer and microbatch (N tokens, top-k). Real routing is data-dependent, so here the
same two quantities are computed from measured token counts (backend/strategies/moe_dispatch.RoutingLog):
per dispatch call, S rows sent by this rank (always N·k: droppless, no capacity factor) and R rows its
experts received from the ep group. With R = N·k the all-to-all payload is exactly traffic.py's uniform value
and the activation term is the one the prediction uses for ep > 1 (memory/moe_bytes.ep_moe_layer_bytes), both tested.

Sources: Lepikhin et al. 2021, GShard, Sec 3.1 / Algorithm 2 (dispatch and combine as AllToAll, forward and
backward); Fedus et al. 2022, Switch Transformer, Sec 2.2 (each expert's computation scales with the tokens
routed to it: "expert capacity"; unbounded unless the spec sets a capacity factor: then each record also carries
the rows routed before the limit and the padded rows, `dropped_given_routing` recomputes the drops from them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from backend.analytic.layout import Layout
from backend.analytic.memory.activations import LayerShape, layer_activation_bytes, mlp_elems
from backend.analytic.memory.moe_bytes import ep_moe_layer_bytes, hidden_saved, row_bytes
from backend.analytic.moe_capacity import dropped_slots
from backend.analytic.params import is_gated

if TYPE_CHECKING:
    from backend.spec import ExperimentSpec

COUNT_BYTES = 8  # moe_dispatch exchanges E int64 counts before the rows


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
    routed: list[int] | None = None
    """Under a capacity factor: rows routed to each expert before the limit (sent: after it)."""
    padded: int = 0
    """Under pad_to_capacity: the rows every expert takes from every rank (the real ones + zero rows)."""

    @property
    def sent_rows(self) -> int:
        return sum(self.sent)

    @property
    def received_rows(self) -> int:
        return sum(map(sum, self.received))

    @property
    def wire_sent_rows(self) -> int:
        """Rows on the wire out of this rank: the padded buffer under pad_to_capacity."""
        return self.padded * len(self.sent) if self.padded else self.sent_rows

    @property
    def wire_received_rows(self) -> int:
        return self.padded * sum(map(len, self.received)) if self.padded else self.received_rows


def dispatches(routing: dict[str, Any]) -> list[Dispatch]:
    """The ep strategy's payload entry (backend/strategies/ep.routing_payload) as Dispatch records."""
    return [Dispatch(microbatch=r["microbatch"], layer=str(r["layer"]), sent=list(r["sent"]),
                     received=[list(x) for x in r["received"]], recompute=bool(r.get("recompute", False)),
                     routed=list(r["routed"]) if r.get("routed") is not None else None, padded=int(r.get("padded", 0)))
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
    rows = d.wire_sent_rows + d.wire_received_rows
    # GShard Alg. 2: the E counts, then dispatch (S rows leave) and combine (R rows go back)
    fwd = COUNT_BYTES * n_experts + rows * row
    if d.recompute:
        return fwd
    return fwd + rows * row  # GShard Sec 3.1: backward runs both transposed (S and R)


def all_to_all_bytes(ds: list[Dispatch], *, h: int, dtype_bytes: float, n_experts: int) -> float:
    """all_to_all payload of a step on this rank: sum over its dispatch calls."""
    return sum(all_to_all_call_bytes(d, h=h, dtype_bytes=dtype_bytes, n_experts=n_experts) for d in ds)


def predicted_moe_layer_bytes(spec: ExperimentSpec) -> float:
    """The MoE term inside the uniform prediction's per-layer bytes: memory/activations' block bytes with experts
    minus without (+ the dense MLP term that replaces them), so a change of that model is followed here.
    For ep > 1 it is `ep_moe_layer_bytes` at uniform counts."""
    # the MoE blocks' shape (block 0 may be dense: a dense prefix, an interleave); shared experts are dense
    shape, rc = replace(LayerShape.of_spec(spec, moe_block=True), shared_ffn=0), str(spec.train.recompute)
    with_experts = layer_activation_bytes(shape, rc)
    dense = layer_activation_bytes(replace(shape, n_experts=0), rc)
    mlp = mlp_elems(s=shape.seq_len, b=shape.micro_batch, h=shape.d_model, ffn=shape.ffn, t=shape.tp,
                    hidden=hidden_saved(shape.mlp)) * shape.dtype_bytes
    return with_experts - dense + mlp


def peak_microbatch(ds: list[Dispatch], **kw: Any) -> tuple[float, int, int | None]:
    """(largest EP MoE saved bytes of any one microbatch, its MoE layer count, that microbatch): a microbatch's
    saved tensors are freed by its backward before the next one starts, so the activation peak falls in the
    heaviest one. kw: tokens, h, ffn, n_experts, top_k, dtype_bytes, autocast."""
    per_mb: dict[int, list[float]] = {}
    for d in ds:
        if not d.recompute:
            capped = {} if d.routed is None else {"kept_rows": d.sent_rows, "padded": bool(d.padded)}
            per_mb.setdefault(d.microbatch, []).append(ep_moe_layer_bytes(received_rows=d.wire_received_rows,
                                                                          **capped, **kw))
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


def adjustment(spec: ExperimentSpec, routing: dict[str, Any]) -> RoutingAdjustment:
    """This rank's all_to_all payload and MoE activation bytes for its measured routing, with the EP dispatch's
    own saved tensors and row dtype. Full recompute keeps no MoE tensors across the step: no activation
    adjustment then."""
    m, t = spec.model, spec.train
    layout = Layout.of(spec)
    cb, ac = layout.compute_bytes, bool(layout.uses_autocast)
    ds = dispatches(routing)
    n, k, e = routing["tokens"], routing["top_k"], routing["n_experts"]
    a2a = all_to_all_bytes(ds, h=m.d_model, dtype_bytes=row_bytes(cb, ac), n_experts=e)
    etp = spec.parallel.etp if spec.parallel.ep > 1 else 1  # each local expert's (rows, ffn) tensors split over etp
    layer_kw = dict(tokens=n, h=m.d_model, ffn=m.expert_ffn // etp, n_experts=e, top_k=k, dtype_bytes=cb, autocast=ac,
                    hidden=hidden_saved(m.mlp), gated=is_gated(m.mlp))
    measured, n_layers, mb = peak_microbatch(ds, **layer_kw)
    act = 0.0 if str(t.recompute) == "full" else measured - n_layers * predicted_moe_layer_bytes(spec)
    first = [d for d in ds if not d.recompute]
    uniform = len(first) * n * k  # droppless: every rank's experts get N·k slots per layer and microbatch on average
    return RoutingAdjustment(all_to_all_bytes=a2a, activations_delta_bytes=act,
                             received_slots=sum(d.received_rows for d in first), uniform_slots=uniform,
                             peak_microbatch=mb)


def dropped_given_routing(routing: dict[str, Any], factor: float | None) -> int:
    """The slots Megatron's capacity limit drops for this rank's measured routing: over its first forwards, sum_e
    max(0, routed_e - C) (analytic/moe_capacity.dropped_slots) at its T tokens per MoE call."""
    return sum(dropped_slots(d.routed, tokens=routing["tokens"], top_k=routing["top_k"], factor=factor)
               for d in dispatches(routing) if not d.recompute and d.routed is not None)
