"""What one transformer block's backward holds beyond the block's saved activations, at its fullest op: the
gradients flowing through it, each op's new outputs and the weight gradients it makes (`block_backward_extra`).

The block's backward runs its forward's ops in reverse (backend/models/gpt.py Block: ln1, q / k / v, the attention
core, o, the residual add, ln2, the MLP, the residual add). Each op allocates the gradients of its inputs while its
saved tensors and the gradient it received are still alive, then frees them. A `Ledger` walks that order with the
tensors that matter at the size of a block (token x hidden, token x ffn, the (s, s) scores per head, weight-sized
gradients) and keeps the largest running total above the entry, where every saved tensor of the block and the
gradient of its output are alive. Small terms (LayerNorm statistics, biases, rotary tables) are left out: they
are below 1% of the block's working set at the sizes where this moment decides what fits.

Weight gradients (`WeightGrads`): the persistent `.grad` of DDP / ZeRO-1 is accumulated in place (the new gradient
lives only while it is added; under autocast it comes in the 16-bit compute dtype and is cast to fp32 first);
FSDP2's unsharded parameters get fresh gradients that stay alive until the unit's post-backward (16-bit under the
pure FSDP strategies' MixedPrecisionPolicy, fp32 in the tp / pp / ep mixes, whose units compute under autocast);
the distributed optimizer's 16-bit parameters hand theirs to the fp32 main-grad buffer (a post-accumulate hook).
Read off the engine's own backward op by op with MemTracker on the CPU (tests/unit/test_block_backward.py compares
the ledger's peak with the measured one per family, dtype and weight-gradient mode).
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.analytic.memory.moe_bytes import hidden_saved
from backend.analytic.params import is_gated

ACCUMULATE, FRESH, FRESH_HELD = 0, 1, 2
"""Weight-gradient modes: added in place into a persistent grad (DDP, ZeRO-1, the distributed optimizer's main grads);
fresh and held until the unit's post-backward (FSDP2); fresh and held across microbatches (FSDP2 under pipelining,
replicate without sync): the same inside one block, named apart for the callers."""


@dataclass(frozen=True)
class WeightGrads:
    """How a Linear's weight gradient is made and kept: `made` bytes per element the matmul writes (the compute dtype),
    `cast` the fp32 copy autocast's weight cast adds (0 without autocast), `held` whether it stays alive until the
    unit's post-backward (FSDP2) rather than being added in place into a persistent grad."""
    made: float
    cast: float
    held: bool


def weight_grads(*, dtype_bytes: int, autocast: bool, held: bool) -> WeightGrads:
    return WeightGrads(made=dtype_bytes, cast=4.0 if autocast and dtype_bytes != 4 else 0.0, held=held)


class Ledger:
    """Running bytes above the block's entry and their maximum."""

    def __init__(self) -> None:
        self.now = 0.0
        self.peak = 0.0

    def alloc(self, nbytes: float) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def free(self, nbytes: float) -> None:
        self.now -= nbytes

    def linear(self, *, grad_in: float, grad_out: float, saved_in: float, weight: float, wg: WeightGrads) -> None:
        """One Linear's backward (bytes, weight in elements): the input grad and the weight grad (the matmuls), then
        its saved input, the grad it received and, under autocast, the 16-bit weight copy its matmul saved are freed;
        autocast's weight cast turns the weight grad into fp32 (ToCopyBackward); a persistent grad adds it in place and
        drops it, FSDP2 holds it."""
        self.alloc(grad_in)
        self.alloc(weight * wg.made)
        self.free(saved_in + grad_out + (weight * wg.made if wg.cast else 0.0))
        if wg.cast:
            self.alloc(weight * wg.cast)
            self.free(weight * wg.made)
        if not wg.held:
            self.free(weight * (wg.cast or wg.made))


def block_backward_extra(*, s: int, b: int, h: int, a: int, ffn: int, t: int, sp: bool, dtype_bytes: int,
                         autocast: bool, flash: bool, mlp: str, q_width: int = 0, v_width: int = 0, kv_heads: int = 0,
                         wg: WeightGrads, selective: bool = False, norm_saved: float | None = None,
                         norm_temp: float = 0.0) -> float:
    """Peak bytes of one dense block's backward above its entry (every saved tensor of the block alive, under
    autocast its Linears' 16-bit weight copies too, plus the gradient of its output). s is this rank's share of the
    sequence, t the tensor-parallel degree (heads and ffn split; LayerNorm tensors whole unless sp). `selective`:
    the attention core is re-run inside its checkpoint, so its scores are re-made before their backward.
    `norm_saved`: what one norm saved (default LayerNorm's: its input and fp32 mean / rstd), freed by its backward;
    `norm_temp`: what its backward allocates on the way (the CPU's composite RMSNorm: fp32 intermediates)."""
    cb = dtype_bytes
    rb = 4 if autocast else cb  # the residual stream, LayerNorm outputs and the grads autocast casts back to
    tok = s * b
    qw, vw = (q_width or h) / t, (v_width or q_width or h) / t
    kvw = qw if not kv_heads else qw * kv_heads / a
    f = ffn / t
    scores = b * a / t * s * s
    full = tok * h  # a Linear's (all-gathered) input and its input gradient
    norm = tok / (t if sp else 1) * h  # LayerNorm inputs / outputs (sequence-split under SP)
    cast = full * cb if autocast else 0.0  # autocast: each Linear saves its own 16-bit copy of its input
    if norm_saved is None:
        norm_saved = norm * rb + 2 * norm / h * 4
    led = Ledger()

    def linear(grad_in: float, grad_out: float, saved_in: float, weight: float) -> None:
        led.linear(grad_in=grad_in, grad_out=grad_out, saved_in=saved_in, weight=weight, wg=wg)

    def input_grad_back() -> None:  # ToCopyBackward of autocast's input cast: the grad back in fp32
        if autocast:
            led.alloc(full * rb)
            led.free(full * cb)

    # --- MLP sublayer: its output grad is the block's (cast to 16-bit under autocast) ---
    led.alloc(cast)
    g16 = cast
    hid = tok * f * cb
    if is_gated(mlp):
        linear(hid, g16, hid, h * f)  # down: its input, the product
        led.alloc(2 * hid)  # mul backward: grads of silu(gate) and of up
        led.free(hid + 2 * hid)  # the product's grad; silu's output and up's output (the mul's saved)
        led.alloc(hid)  # silu backward
        led.free(hid + (hidden_saved(mlp) - 3) * hid)  # its grad in; gate's output (and clamped SwiGLU's extras)
        linear(full * cb, hid, cast, h * f)  # up
        input_grad_back()
        linear(full * cb, hid, cast or full * cb, h * f)  # gate (pure 16-bit: the shared ln2 output goes now)
        input_grad_back()
        led.alloc(full * rb)  # the two input grads summed
        led.free(2 * full * rb)
    else:
        linear(hid, g16, hid, h * f)  # fc_out: its input, GELU's output
        led.alloc(hid)  # gelu backward
        led.free(2 * hid)  # its grad in, fc_in's output (GELU's saved input)
        linear(full * cb, hid, cast or full * cb, h * f)  # fc_in (pure 16-bit: its input is ln2's output)
        input_grad_back()
    led.alloc(norm_temp)  # ln2 backward
    led.alloc(norm * rb)
    led.free(norm_temp + full * rb + norm_saved)  # its intermediates, the grad of its output, what it saved
    led.alloc(norm * rb)  # the residual sum: the grad of the sublayer's input
    led.free(2 * norm * rb)  # ln2's input grad and the block's output grad
    # --- attention sublayer ---
    led.alloc(cast)
    o_in = tok * vw * cb
    linear(tok * qw * cb, cast, 0.0 if flash else o_in, qw * h)  # o (flash: its input is the kernel's saved output)
    if flash:
        led.alloc(tok * (2 * qw + vw) * cb)  # dq, dk, dv (GQA: at every head, as the kernel saw k and v repeated)
        led.free(tok * qw * cb + tok * (2 * qw + vw) * cb + o_in)  # the grad in; q, k, v and the output it saved
    else:
        if selective:
            led.alloc(2 * scores * cb)  # the core re-run: scores, then the probabilities kept
            led.free(scores * cb)
        led.alloc(scores * cb + tok * vw * cb)  # probs @ v backward: grads of the probabilities and of v
        led.free(tok * qw * cb + tok * vw * cb)  # the grad in, v
        led.alloc(scores * cb)  # softmax backward
        led.free(2 * scores * cb)  # the probabilities and their grad
        led.alloc(2 * tok * qw * cb)  # q @ k^T backward: dq, dk
        led.free(scores * cb + 2 * tok * qw * cb)  # the scores' grad, the q / k the matmul saved
    kv_share = kvw / qw  # GQA: repeat_interleave's backward sums the repeated heads' grads back to k / v's width
    if kv_share < 1:
        led.alloc(tok * (qw + vw) * kv_share * cb)
        led.free(tok * (qw + vw) * cb)
    for i, width in enumerate((vw * kv_share, kvw, qw)):  # v, k, q: input grads summed into the grad of ln1's output
        linear(full * cb, tok * width * cb, cast or (full * cb if i == 2 else 0.0), h * width)
        input_grad_back()
        if i:
            led.alloc(full * rb)
            led.free(2 * full * rb)
    led.alloc(norm_temp)  # ln1 backward
    led.alloc(norm * rb)
    led.free(norm_temp + full * rb + norm_saved)
    led.alloc(norm * rb)  # the residual sum
    return led.peak
