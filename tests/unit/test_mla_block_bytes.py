"""What one multi-head latent attention block (DeepSeek-V2/V3's MLA, dense MLP) keeps for backward, against the eager
block on the CPU: saved_tensors_hooks on the block, parameters and autocast's weight casts left out, each storage
once. Covers the latent norms by device (family_bytes.latent_norm_bytes), the v that is a view of kv_b's output or a
copy of it (family_bytes.v_view_elems), and flash attention over a zero-padded v (models/gpt.py
_padded_flash_attention), in the three ways this engine runs a block."""

from __future__ import annotations

from dataclasses import replace

import pytest

from backend.analytic.memory.activations import LayerShape, layer_activation_bytes
from backend.analytic.memory.family_bytes import latent_norm_bytes
from backend.spec import ExperimentSpec
from tests.helpers.saved_bytes import MODES, block_saved_bytes

pytestmark = pytest.mark.unit

MLA = {"vocab_size": 256, "d_model": 128, "n_layers": 1, "n_heads": 4, "seq_len": 64, "norm": "rmsnorm",
       "mlp": "swiglu", "positions": "rope", "bias": "none", "ffn_hidden": 352, "tie_embeddings": False,
       "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}


def _spec(mode: str, micro_batch: int = 2, **model) -> ExperimentSpec:
    precision, strategy = MODES[mode]
    return ExperimentSpec.for_prediction({
        "model": MLA | model, "train": {"global_batch": 2 * micro_batch, "micro_batch": micro_batch,
                                        "precision": precision},
        "parallel": {"strategy": strategy, "world_size": 2}, "runtime": {"device": "cpu"}})


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("attention", ["math", "flash"])
@pytest.mark.parametrize("micro_batch", [1, 2])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_an_eager_mla_block_keeps_what_the_model_counts(mode, attention, micro_batch, recompute):
    spec = _spec(mode, micro_batch, attention=attention)
    shape = LayerShape.of_spec(spec)
    assert (shape.q_lora, shape.kv_lora, shape.autocast) == (48, 32, mode == "autocast")
    assert block_saved_bytes(spec, mode, recompute == "selective") == layer_activation_bytes(shape, recompute)


@pytest.mark.parametrize("mode", list(MODES))
def test_mla_without_a_q_latent_keeps_what_the_model_counts(mode):
    spec = _spec(mode, attention="flash", q_lora_rank=None)
    shape = LayerShape.of_spec(spec)
    assert shape.q_lora == 0
    assert block_saved_bytes(spec, mode, False) == layer_activation_bytes(shape, "none")


def test_latent_norms_on_cuda_keep_the_fused_kernels_input_with_kv_as_rotary_key_view():
    """bf16 weights on CUDA: each fused norm keeps its 16-bit input (kv_a's: a view of [latent | rotary key]) and an
    fp32 rstd, plus the next Linear's 16-bit input; autocast and the CPU run the composite (fp32 input copy of the
    latent, fp32 normalised x and rstd)."""
    shape = replace(LayerShape.of_spec(_spec("bf16_params")), device="cuda")
    rows = 2 * 64
    assert latent_norm_bytes(shape) == rows * ((48 * 2 + 4 + 48 * 2) + (32 * 2 + 4 + 32 * 2) + 8 * 2)
    composite = rows * ((4 * (2 * 48 + 1) + 48 * 2) + (4 * (2 * 32 + 1) + 32 * 2))
    assert latent_norm_bytes(replace(shape, autocast=True)) == composite
    assert latent_norm_bytes(replace(shape, device="cpu")) == composite
    assert latent_norm_bytes(replace(shape, tp=2)) == latent_norm_bytes(shape)  # every tp rank holds the latents
    assert latent_norm_bytes(replace(shape, kv_lora=0)) == 0


def test_padded_flash_attention_equals_math_attention_in_output_and_gradients():
    """The zero-padded v (gpt._padded_flash_attention) changes nothing a user can see: a block run with flash and with
    math attention gives the same output and the same input and weight gradients (fp32, same weights)."""
    import torch

    from backend.models.gpt import build_model

    outs = {}
    for attention in ("math", "flash"):
        m = _spec("fp32", attention=attention).model
        block = build_model(m, seed=0).layers["0"]
        x = torch.randn(2, m.seq_len, m.d_model, generator=torch.Generator().manual_seed(1), requires_grad=True)
        block(x).square().sum().backward()
        outs[attention] = [x.grad] + [p.grad for p in block.parameters()]
    torch.testing.assert_close(outs["flash"], outs["math"])


def test_the_engines_cpu_flash_kernel_is_timed_at_the_padded_width_a_gpus_at_its_own():
    """On the CPU this engine runs flash over v padded to d_qk (24 here, v 16), so a CPU profile times a d_qk wide
    call; a GPU profile (CUDA's kernels) and other stacks' kernels take d_qk and d_v as they are (their mean). The FLOPs
    counted for MFU stay the model's."""
    from backend.analytic.layout import Layout
    from backend.analytic.steptime.compute import attention_pass
    from backend.analytic.steptime.hardware import get_hardware
    from backend.analytic.steptime.ops import attention_time

    passes, times = {}, {}
    for hw_key, stack in (("cpu", "shardlab"), ("h100-sxm", "shardlab"), ("cpu", "megatron")):
        hw = replace(get_hardware("h100-sxm"), kind="cpu") if hw_key == "cpu" else get_hardware(hw_key)
        spec = ExperimentSpec.for_prediction({
            "model": MLA | {"attention": "flash", "seq_len": 4096},
            "train": {"global_batch": 8, "micro_batch": 1, "precision": "bf16-mixed", "stack": stack},
            "parallel": {"strategy": "zero3", "world_size": 8}})
        passes[hw_key, stack] = attention_pass(spec.model, Layout.of(spec), hw, "flash2")
        times[hw_key, stack] = {d: attention_time(hw, "bf16-mixed", "flash2", 1, 4, 4096, d)[0] for d in (20, 24)}
    assert passes["cpu", "shardlab"].fwd_s == times["cpu", "shardlab"][24]
    for other in (("h100-sxm", "shardlab"), ("cpu", "megatron")):
        assert passes[other].fwd_s == times[other][20]
    assert {p.fwd_flops for p in passes.values()} == {2 * 4 * 4096 * 4096 * (24 + 16)}


def test_on_cuda_the_flash_path_keeps_v_as_a_view_of_kv_b_output():
    """CUDA's memory-efficient kernel takes v as it comes, a view of kv_b's (nope + v) output: the view's nope part is
    kept there, and not on the CPU, whose flash kernel gets a padded copy."""
    cpu = LayerShape.of_spec(_spec("bf16_params", attention="flash"))
    cuda = replace(cpu, device="cuda")
    nope_bytes = 2 * 64 * 4 * 16 * 2  # rows x a x qk_nope_head_dim x 2 B
    assert layer_activation_bytes(cuda) - layer_activation_bytes(replace(cuda, v_view_extra=0)) == nope_bytes
    assert layer_activation_bytes(cpu) == layer_activation_bytes(replace(cpu, v_view_extra=0))


@pytest.mark.parametrize("attention", ["math", "flash"])
def test_op_level_recompute_of_mla_keeps_its_own_linears_outputs(attention):
    """torchtitan's op-level SAC on MLA blocks keeps every second aten.mm output of MLA's own linears (q_a, q_b,
    kv_a, kv_b, o, then the MLP's), the flash kernel's padded d_qk output on the CPU, or math's (b·a, s, d_v) P·V;
    it was counted over q, k, v and o of width d_model (+10% .. +14% in fp32). The engine's microbatch loop, its
    tracker at the activation peak, against estimate(): exact in fp32."""
    import torch

    from backend.analytic.estimate import estimate
    from tests.helpers.activation_peak import engine_step_activation_peak

    torch.manual_seed(0)
    model = {k: v for k, v in MLA.items() if k not in ("ffn_hidden",)} | {
        "n_layers": 4, "d_model": 64, "seq_len": 32, "vocab_size": 128, "q_lora_rank": 32, "kv_lora_rank": 16,
        "attention": attention}
    spec = ExperimentSpec(model=model, train={"global_batch": 4, "micro_batch": 2, "recompute": "op"},
                          parallel={"strategy": "ddp", "world_size": 1})
    assert estimate(spec).per_rank[0].activations_bytes == engine_step_activation_peak(spec)
