"""GPT-style decoder (dense or MoE) that `backend.analytic.params` counts to the element.

Layout (names are relied on by the TP plan and the PP splitter):
  tok_emb, pos_emb -> layers["0".."L-1"] (ln1, attn.{q,k,v,o}, ln2, mlp.{fc_in, fc_out} | moe) -> norm -> lm_head
All linear layers carry a bias except lm_head and the MoE router. Embeddings are untied.
Pipeline stages are built by deleting modules (tok_emb/pos_emb/norm/lm_head set to None, layers popped
from the ModuleDict), as torchtitan does, so parameter names stay stable across strategies.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from backend.spec import ModelSpec, Recompute


class Attention(nn.Module):
    def __init__(self, m: ModelSpec):
        super().__init__()
        self.head_dim = m.head_dim
        kv_dim = m.kv_heads * m.head_dim
        self.q = nn.Linear(m.d_model, m.d_model)
        self.k = nn.Linear(m.d_model, kv_dim)
        self.v = nn.Linear(m.d_model, kv_dim)
        self.o = nn.Linear(m.d_model, m.d_model)
        self.selective_recompute = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # view(..., -1, head_dim) keeps working when TP leaves only the local heads on this rank.
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, a, T, d)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, kv, T, d)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        if k.shape[1] != q.shape[1]:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.selective_recompute and torch.is_grad_enabled():
            y = checkpoint(_core_attention, q, k, v, use_reentrant=False)
        else:
            y = _core_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)


def _core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # Explicit softmax(QK^T)V, not SDPA: it saves the (B, a, T, T) scores that Korthikanti's 5as/h term counts.
    T = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (B, a, T, T)
    mask = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    return probs @ v  # (B, a, T, d)


class MLP(nn.Module):
    def __init__(self, d_model: int, ffn: int):
        super().__init__()
        self.fc_in = nn.Linear(d_model, ffn)
        self.fc_out = nn.Linear(ffn, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class MoE(nn.Module):
    """Top-k routed experts, no capacity limit (every token reaches its k experts: exact, droppless).

    `dispatch` is swapped by the ep strategy for an all-to-all version; this dense one is the reference.
    """

    def __init__(self, m: ModelSpec):
        super().__init__()
        self.top_k = m.top_k
        self.n_experts = m.n_experts
        self.router = nn.Linear(m.d_model, m.n_experts, bias=False)
        self.experts = nn.ModuleList(MLP(m.d_model, m.ffn) for _ in range(m.n_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.router(x)  # (N, E)
        weights, idx = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)  # (N, k)
        return weights / weights.sum(-1, keepdim=True), idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(-1, C)  # (N, C)
        weights, idx = self.route(flat)
        return self.dispatch(flat, weights, idx).view(B, T, C)

    def dispatch(self, flat: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)
            if tok.numel():
                out.index_add_(0, tok, (expert(flat[tok]) * weights[tok, slot].unsqueeze(-1)).to(out.dtype))
        return out


class Block(nn.Module):
    def __init__(self, m: ModelSpec):
        super().__init__()
        self.ln1 = nn.LayerNorm(m.d_model)
        self.attn = Attention(m)
        self.ln2 = nn.LayerNorm(m.d_model)
        self.mlp = MoE(m) if m.is_moe else MLP(m.d_model, m.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, m: ModelSpec):
        super().__init__()
        self.spec = m
        self.tok_emb: nn.Embedding | None = nn.Embedding(m.vocab_size, m.d_model)
        self.pos_emb: nn.Embedding | None = nn.Embedding(m.seq_len, m.d_model)
        self.layers = nn.ModuleDict({str(i): Block(m) for i in range(m.n_layers)})
        self.norm: nn.LayerNorm | None = nn.LayerNorm(m.d_model)
        self.lm_head: nn.Linear | None = nn.Linear(m.d_model, m.vocab_size, bias=False)
        self.full_recompute = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) int64 on the first stage, hidden (B, T, C) on later ones; logits (B, T, V) on the last."""
        h = tokens
        if self.tok_emb is not None:
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            h = self.tok_emb(tokens) + self.pos_emb(pos)  # (B, T, C)
        for layer in self.layers.values():
            h = checkpoint(layer, h, use_reentrant=False) if self.full_recompute and torch.is_grad_enabled() else layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        return h


def set_recompute(model: GPT, mode: Recompute) -> None:
    model.full_recompute = mode == Recompute.FULL
    for layer in model.layers.values():
        layer.attn.selective_recompute = mode == Recompute.SELECTIVE


def build_model(m: ModelSpec, *, seed: int, recompute: Recompute = Recompute.NONE,
                device: str | torch.device = "cpu") -> GPT:
    """The full model with the weights every strategy and rank uses (`init_weights`); `device="meta"` builds
    it without storage (the engine's path: parallelize first, then materialize only this rank's shards)."""
    with torch.device("meta"):
        model = GPT(m)
    set_recompute(model, recompute)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        init_weights(model, seed)
    return model


def param_seed(seed: int, name: str) -> int:
    """The generator seed of one parameter: a function of (seed, parameter name) only, so a rank holding any
    slice of a parameter draws it from the same full tensor as the single-process reference."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def full_init(name: str, shape: torch.Size | tuple[int, ...], seed: int) -> torch.Tensor:
    """The full fp32 initial value of parameter `name` on the CPU: N(0, 0.02) for matrices and embeddings,
    zeros for biases, ones for norm weights (LayerNorm's own default)."""
    if len(shape) >= 2:
        g = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
        return torch.empty(shape, dtype=torch.float32, device="cpu").normal_(0.0, 0.02, generator=g)
    fill = 0.0 if name.endswith("bias") else 1.0
    return torch.full(shape, fill, dtype=torch.float32, device="cpu")


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, local_slice=None) -> None:
    """Write every parameter's initial value, one parameter at a time: the full tensor is drawn on the CPU and
    `local_slice(param, full)` (default: all of it) picks what this rank holds (a DTensor shard, an FSDP shard).
    Largest first: the big full-size temporaries come while few local shards exist yet, so the host peak stays
    near the local shards plus one block-sized parameter."""
    for name, p in sorted(model.named_parameters(), key=lambda kv: -kv[1].numel()):
        full = full_init(name, p.shape, seed)
        local = full if local_slice is None else local_slice(p, full)
        dst = p.to_local() if hasattr(p, "to_local") else p
        dst.copy_(local.to(device=dst.device, dtype=dst.dtype))
        del full, local
    for name, mod in model.named_modules():
        if any(True for _ in mod.buffers(recurse=False)):
            if not hasattr(mod, "reset_buffers"):
                raise TypeError(f"{name or 'model'} ({type(mod).__name__}) has buffers but no reset_buffers(): "
                                "after to_empty they would hold garbage; give it one that recomputes them")
            mod.reset_buffers()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
