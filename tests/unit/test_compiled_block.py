"""What a block under torch.compile keeps for backward (memory/compiled_block.py), against what torch 2.13's Inductor
keeps on the CPU: the compiled graph's saved tensors (saved_tensors_hooks see CompiledFunction's
save_for_backward), parameters left out, each storage once. The stack model prices torchtitan's compiled blocks with
it (stack_activations._block_terms)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from backend.analytic.layout import Layout
from backend.analytic.memory.activations import LayerShape
from backend.analytic.memory.compiled_block import compiled_block_bytes
from backend.analytic.memory.stack_activations import block_terms
from backend.spec import ExperimentSpec

pytestmark = pytest.mark.unit

BASE = {"vocab_size": 256, "d_model": 256, "n_layers": 1, "n_heads": 4, "seq_len": 256, "attention": "flash",
        "tie_embeddings": False}
FAMILIES = {
    "gpt2": {"norm": "layernorm", "mlp": "gelu", "positions": "learned", "bias": "all", "ffn_hidden": 1024},
    "llama-gqa": {"norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": "none", "n_kv_heads": 2,
                  "ffn_hidden": 704},
    "qk-norm-clamped": {"norm": "rmsnorm", "mlp": "swiglu_clamped", "positions": "rope", "bias": "all",
                        "n_kv_heads": 2, "ffn_hidden": 704, "qk_norm": True},
}
MICRO_BATCH = 2


def _spec(family: dict, elementwise: str = "compiled", device: str = "cpu", stack: str = "torchtitan",
          strategy: str = "zero3") -> ExperimentSpec:
    return ExperimentSpec.for_prediction({
        "model": BASE | family,
        "train": {"global_batch": 2 * MICRO_BATCH, "micro_batch": MICRO_BATCH, "precision": "bf16-mixed",
                  "stack": stack, "elementwise": elementwise},
        "parallel": {"strategy": strategy, "world_size": 2}, "runtime": {"device": device}})


def _inductor_saved_bytes(spec: ExperimentSpec, autocast: bool = False, selective: bool = False) -> int:
    """autocast: fp32 weights and input under torch.autocast("cpu", bfloat16), as stack shardlab's engine runs a
    block (its weights' 16-bit casts are among the saved tensors); else a bf16 block, as FSDP2's MixedPrecisionPolicy
    runs it. selective: the engine's selective recompute (the attention core checkpointed, models/gpt.py)."""
    import contextlib

    import torch

    from backend.models.gpt import build_model

    m = spec.model
    dtype = torch.float32 if autocast else torch.bfloat16
    block = build_model(m, seed=0).to(dtype).layers["0"]
    block.attn.selective_recompute = selective
    # each call compiles a new block of another shape or mode: past Dynamo's recompile limit for the block's code it
    # would run it eagerly, without a word, and measure the eager block
    torch.compiler.reset()
    run = torch.compile(block)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}

    def x():
        return torch.randn(MICRO_BATCH, m.seq_len, m.d_model, dtype=dtype, requires_grad=True)

    def region():
        return torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    with region():
        run(x()).sum().backward()  # compiles
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with region(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(x())
    return sum(saved.values())


@pytest.mark.heavy
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_compiled_block_keeps_what_inductor_saves(family):
    """The plain block of stack torchtitan with elementwise compiled is what Inductor saves, to its norms'
    statistics: the model counts them in fp32 (CUDA's kernels), the CPU's LayerNorm keeps them in bf16 (sb x 4 B at
    most, under 0.1% here)."""
    spec = _spec(FAMILIES[family])
    plain = block_terms(spec.model, Layout.of(spec))[0]
    assert _inductor_saved_bytes(spec) == pytest.approx(plain, rel=1e-3)


def test_compiled_blocks_drop_the_gated_activation_and_rope_tables_and_keep_gelus():
    """Against the eager block on CUDA ranks: a gated MLP's activation output (and the clamped SwiGLU's four more
    intermediates) and the RoPE tables go; a GELU block keeps the same bytes (its norm input swapped for the attention
    output, both s b h)."""
    for family, dropped_f in (("gpt2", 0), ("llama-gqa", 1)):
        cuda = [_spec(FAMILIES[family], kind, "cuda") for kind in ("compiled", "eager")]
        c_plain, e_plain = (block_terms(s.model, Layout.of(s))[0] for s in cuda)
        m = cuda[0].model
        sb = m.seq_len * MICRO_BATCH
        rope = 2 * m.seq_len * (m.d_model // m.n_heads) * 2 if family != "gpt2" else 0
        assert e_plain - c_plain == pytest.approx(dropped_f * sb * m.ffn * 2 + rope, rel=1e-9)


def test_unmeasured_families_keep_the_eager_terms():
    shape = LayerShape(seq_len=64, micro_batch=1, d_model=64, n_heads=4, ffn=128, dtype_bytes=2, flash=True)
    assert compiled_block_bytes(shape) is not None
    for change in ({"tp": 2}, {"n_experts": 8}, {"kv_lora": 32}, {"sandwich_norm": True}, {"windowed": True},
                   {"flash": False}):
        assert compiled_block_bytes(LayerShape(**{**shape.__dict__, **change})) is None, change


@pytest.mark.heavy
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_compiled_autocast_block_keeps_its_fp32_input_and_its_weight_casts(family):
    """Stack shardlab's engine compiles blocks that run under autocast: Inductor keeps what a bf16 block keeps, the
    block input in fp32 instead (the residual stream), and every Linear weight's 16-bit cast, as eager autocast does
    (rank_activations.autocast_casts). Byte for byte, the norms' fp32 statistics included."""
    spec = _spec(FAMILIES[family], stack="shardlab", strategy="ddp")  # ddp's engine runs the blocks under autocast
    shape = LayerShape.of_spec(spec)
    assert shape.autocast
    block = build_model_block(spec)
    casts = 2 * sum(p.numel() for p in block.parameters() if p.dim() == 2)
    sb, h = MICRO_BATCH * spec.model.seq_len, spec.model.d_model
    assert compiled_block_bytes(shape) == compiled_block_bytes(replace(shape, autocast=False)) + sb * h * (4 - 2)
    assert _inductor_saved_bytes(spec, autocast=True) == compiled_block_bytes(shape) + casts


def build_model_block(spec: ExperimentSpec):
    from backend.models.gpt import build_model

    return build_model(spec.model, seed=0).layers["0"]


@pytest.mark.heavy
@pytest.mark.parametrize("family", ["gpt2", "qk-norm-clamped"])
def test_a_compiled_block_with_its_attention_core_checkpointed_drops_the_cores_output(family):
    """The engine's selective recompute under compile, bf16 and under autocast: the compiled block less the attention
    output and its fp32 log-sum-exp, plus the CPU generator state the checkpoint saves (host memory, left out of the
    model). The GELU block's CPU LayerNorm keeps its statistics in bf16 outside autocast, where the model counts
    CUDA's fp32: 2 B less per statistic."""
    import torch

    rng_state = torch.get_rng_state().numel()
    for autocast in (False, True):
        spec = _spec(FAMILIES[family], stack="shardlab", strategy="ddp" if autocast else "zero3")
        shape = LayerShape.of_spec(spec)
        assert shape.autocast == autocast
        sb = MICRO_BATCH * spec.model.seq_len
        dropped = sb * (spec.model.d_model * 2 + 4 * spec.model.n_heads)
        assert compiled_block_bytes(shape, selective=True) == compiled_block_bytes(shape) - dropped
        casts = 2 * sum(p.numel() for p in build_model_block(spec).parameters() if p.dim() == 2) if autocast else 0
        bf16_stats = sb * 2 * 2 * (4 - 2) if family == "gpt2" and not autocast else 0  # 2 norms x (mean, rstd)
        measured = _inductor_saved_bytes(spec, autocast=autocast, selective=True)
        assert measured == compiled_block_bytes(shape, selective=True) + casts + rng_state - bf16_stats
