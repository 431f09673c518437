"""Saved bytes of one expert-parallel MoE layer for a given number of routed rows (pure Python, a leaf module).

Read off strategies/moe_dispatch.all_to_all_dispatch: what scales with the rank's OWN tokens (`moe_sender_bytes`)
and what scales with the rows its local experts RECEIVED (`moe_expert_bytes`; Switch Transformer, Fedus et al.
2022, Sec 2.2: each expert's computation scales with the tokens routed to it). Under uniform routing every rank
receives N·k rows (activations.py); measured routings give other counts (measured/moe_routing.py).
"""

from __future__ import annotations

INDEX_BYTES = 8  # int64 indices autograd saves for index ops (topk, nonzero, the sort order)
HIDDEN_SAVED = {"gelu": 2, "swiglu": 4, "geglu": 4, "swiglu_clamped": 7}
"""(tokens, ffn) tensors an MLP saves per hidden unit, read off its autograd graph (tests/unit/test_family_terms.py):
GELU its input and fc_out's input; SwiGLU / GeGLU the gate output, the activation's output, up's output and the product
(Shazeer 2020 Eq. 5-6); gpt-oss's clamped SwiGLU both clamps' inputs, the clamped gate, its sigmoid, gate x sigmoid,
up + 1 and the product down reads."""


def hidden_saved(mlp: str) -> int:
    return HIDDEN_SAVED[str(getattr(mlp, "value", mlp))]


def row_bytes(dtype_bytes: float, autocast: bool) -> float:
    """Bytes per element of the routed rows and of every MoE tensor outside the expert Linears: under torch.autocast
    the ln2 output they come from is fp32 (layer_norm and softmax are on autocast's fp32 op list) and the expert
    outputs are cast back to it (moe_dispatch, like the dense MoE)."""
    return 4 if autocast else dtype_bytes


def moe_sender_bytes(*, tokens: int, h: int, n_experts: int, top_k: int, dtype_bytes: float,
                     autocast: bool = False, kept_rows: float | None = None, padded: bool = False) -> float:
    """Saved bytes of one EP MoE layer that scale with this rank's OWN N tokens (rows = N·k), read off
    moe_dispatch.all_to_all_dispatch: router softmax (N, E); top-k values (N, k) and their sum (N, 1); the
    combine's mul operands, returned rows (rows, h) and weights (rows, 1), and index_add's source (rows, h);
    int64 indices: top-k ids, the sort order and the token of each sorted slot (rows each). Under a capacity limit
    (moe_sorted_dispatch.py) the combine and the sort keep only the `kept_rows` slots within capacity (the top-k ids
    stay N·k); padded: + the kept rows' places in the padded buffer (int64)."""
    rows = tokens * top_k
    kept = rows if kept_rows is None else kept_rows
    elems = tokens * n_experts + rows + tokens + (kept * h + kept) + kept * h
    return elems * row_bytes(dtype_bytes, autocast) + (rows + 2 * kept + (kept if padded else 0)) * INDEX_BYTES


def expert_input_copies(autocast: bool, gated: bool) -> int:
    """(rows, h) copies of an expert's input its Linears keep: one shared input, or under autocast each first Linear's
    own 16-bit cast of the row-dtype input (a gated MLP's gate and up: two)."""
    return 2 if autocast and gated else 1


def moe_expert_bytes(*, received_rows: float, h: int, ffn: int, dtype_bytes: float, autocast: bool = False,
                     hidden: int = 2, gated: bool = False) -> float:
    """Saved bytes of one EP MoE layer's LOCAL experts, which scale with the R rows they received: the first Linears'
    input (R, h; `expert_input_copies`), GELU input and fc_out input (R, ffn) each, index_add's source = expert
    output (R, h, in the row dtype); the int64 row index per local expert (one tensor, saved by x[rows] and
    index_add alike)."""
    # hidden: (R, ffn) tensors per expert call (`hidden_saved`: 2 GELU, 4 SwiGLU, 7 clamped SwiGLU)
    copies = expert_input_copies(autocast, gated)
    linear = (copies * received_rows * h + hidden * received_rows * ffn) * dtype_bytes
    return linear + received_rows * h * row_bytes(dtype_bytes, autocast) + received_rows * INDEX_BYTES


def ep_moe_layer_bytes(*, tokens: int, received_rows: float, h: int, ffn: int, n_experts: int, top_k: int,
                       dtype_bytes: float, autocast: bool = False, hidden: int = 2, kept_rows: float | None = None,
                       padded: bool = False, gated: bool = False) -> float:
    """One MoE layer's saved bytes on an ep rank whose experts received `received_rows` token-slots.
    With received_rows = N·k this is the dense dispatch's MoE term + N·k·h·dtype_bytes (the expert output
    index_add keeps: the dense path keeps its weighted product instead, counted already) + N·k int64 (the sort
    order): see `ep_only_uniform_bytes` (without autocast)."""
    return (moe_sender_bytes(tokens=tokens, h=h, n_experts=n_experts, top_k=top_k, dtype_bytes=dtype_bytes,
                             autocast=autocast, kept_rows=kept_rows, padded=padded)
            + moe_expert_bytes(received_rows=received_rows, h=h, ffn=ffn, dtype_bytes=dtype_bytes, autocast=autocast,
                               hidden=hidden, gated=gated))


def ep_only_uniform_bytes(*, tokens: int, h: int, top_k: int, dtype_bytes: float) -> float:
    """What the all-to-all dispatch saves beyond the dense one per layer under uniform routing (see above)."""
    return tokens * top_k * (h * dtype_bytes + INDEX_BYTES)
