"""Our model's activation formula vs torch's MemTracker (single process, fp32, tiny shapes), and the TP + SP layer
formula vs the tensors the ranks of a real gloo run save for backward (a farm job, tests/helpers/tp_saved_tensors.py).

Activations = bytes MemTracker attributes to "Activation" right after forward + loss, i.e. everything
autograd saved for backward plus the logits the caller holds.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from backend.analytic.memory.activations import (
    LayerShape,
    full_recompute_peak_extra_bytes,
    model_backward_head_transient_bytes,
    model_embedding_head_activation_bytes,
    model_layer_activation_bytes,
)
from backend.models.gpt import build_model, loss_fn
from backend.spec import ModelSpec, Recompute
from tests.helpers.activation_peak import engine_step_activation_peak
from tests.helpers.farm import program_job, uses

TOL = 0.05  # the formula is derived op by op; the brief's bound is 15%


def _measured_activation_bytes(ms: ModelSpec, batch: int, recompute: Recompute) -> int:
    torch.manual_seed(0)
    model = build_model(ms, seed=0, recompute=recompute)
    x = torch.randint(0, ms.vocab_size, (batch, ms.seq_len))
    y = torch.randint(0, ms.vocab_size, (batch, ms.seq_len))
    tracker = MemTracker()
    tracker.track_external(model, x, y)
    with tracker:
        logits = model(x)
        loss = loss_fn(logits, y)
        snap = tracker.get_tracker_snapshot("current")
        loss.backward()
    acts = [v for dev in snap.values() for k, v in dev.items() if str(getattr(k, "value", k)) == "Activation"]
    return sum(acts)


def _predicted(ms: ModelSpec, batch: int, recompute: Recompute) -> float:
    layer = model_layer_activation_bytes(s=ms.seq_len, b=batch, h=ms.d_model, a=ms.n_heads, kv_heads=ms.kv_heads,
                                         ffn=ms.ffn, dtype_bytes=4, recompute=str(recompute),
                                         n_experts=ms.n_experts, top_k=ms.top_k)
    head = model_embedding_head_activation_bytes(s=ms.seq_len, b=batch, h=ms.d_model, vocab=ms.vocab_size,
                                                 dtype_bytes=4)
    return ms.n_layers * layer + head


CASES = [
    ("mha", dict(d_model=64, n_heads=4, seq_len=32), 2, Recompute.NONE),
    ("gqa", dict(d_model=64, n_heads=4, n_kv_heads=2, seq_len=32), 2, Recompute.NONE),
    ("long-seq", dict(d_model=32, n_heads=2, seq_len=64, ffn_hidden=96), 1, Recompute.NONE),
    ("batch-3", dict(d_model=48, n_heads=3, seq_len=16, n_layers=3), 3, Recompute.NONE),
    ("selective", dict(d_model=64, n_heads=4, seq_len=32), 2, Recompute.SELECTIVE),
    ("full", dict(d_model=64, n_heads=4, seq_len=32), 2, Recompute.FULL),
    ("moe", dict(d_model=64, n_heads=4, seq_len=32, n_experts=4, top_k=2), 2, Recompute.NONE),
]


@pytest.mark.parametrize(("name", "model_kw", "batch", "recompute"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.heavy
def test_activation_formula_matches_memtracker(name, model_kw, batch, recompute):
    ms = ModelSpec(**{"vocab_size": 128, "n_layers": 2, **model_kw})
    measured = _measured_activation_bytes(ms, batch, recompute)
    predicted = _predicted(ms, batch, recompute)
    assert predicted == pytest.approx(measured, rel=TOL), (name, predicted, measured)


def test_bf16_model_without_held_logits():
    """A bf16 model (dtype_bytes=2), caller not holding the logits: only log_softmax's fp32 output stays.
    CPU keeps LayerNorm stats in bf16 (the formula assumes fp32 stats, as on CUDA): 0.4% high here."""
    ms = ModelSpec(d_model=64, n_heads=4, seq_len=32, vocab_size=128, n_layers=2)
    model = build_model(ms, seed=0).to(torch.bfloat16)
    x = torch.randint(0, 128, (2, 32))
    y = torch.randint(0, 128, (2, 32))
    tracker = MemTracker()
    tracker.track_external(model, x, y)
    with tracker:
        loss = loss_fn(model(x), y)
        snap = tracker.get_tracker_snapshot("current")
    measured = sum(v for dev in snap.values() for k, v in dev.items() if str(getattr(k, "value", k)) == "Activation")
    layer = model_layer_activation_bytes(s=32, b=2, h=64, a=4, kv_heads=4, ffn=256, dtype_bytes=2)
    head = model_embedding_head_activation_bytes(s=32, b=2, h=64, vocab=128, dtype_bytes=2, logits_held=False)
    assert 2 * layer + head == pytest.approx(measured, rel=TOL)
    assert loss.dtype == torch.float32


def test_backward_peak_is_saved_plus_head_transient():
    """Large vocab: MemTracker's peak = end-of-forward activations + the head's backward temporaries."""
    ms = ModelSpec(d_model=64, n_heads=4, seq_len=32, vocab_size=1024, n_layers=2)
    model = build_model(ms, seed=0)
    x = torch.randint(0, ms.vocab_size, (2, 32))
    y = torch.randint(0, ms.vocab_size, (2, 32))
    tracker = MemTracker()
    tracker.track_external(model, x, y)
    with tracker:
        loss = loss_fn(model(x), y)
        loss.backward()
    peak = {str(getattr(k, "value", k)): v for dev in tracker.get_tracker_snapshot("peak").values()
            for k, v in dev.items()}
    saved = _predicted(ms, 2, Recompute.NONE) - 32 * 2 * 1024 * 4  # caller did not hold the logits
    transient = model_backward_head_transient_bytes(s=32, b=2, vocab=1024, dtype_bytes=4)
    assert peak["Activation"] + peak["Temp"] == pytest.approx(saved + transient, rel=TOL)


def test_recompute_ordering_and_peak_extra():
    """full < selective < none; the full-recompute backward re-materialises one whole block."""
    kw = dict(s=32, b=2, h=64, a=4, kv_heads=4, ffn=256, dtype_bytes=4)
    none, sel, full = (model_layer_activation_bytes(**kw, recompute=r) for r in ("none", "selective", "full"))
    assert full < sel < none
    # one block re-run in backward on top of its already-saved (checkpointed) input
    shape = LayerShape(seq_len=32, micro_batch=2, d_model=64, n_heads=4, ffn=256, dtype_bytes=4)
    assert full_recompute_peak_extra_bytes(shape) == none - full
    assert full_recompute_peak_extra_bytes(shape, head_freed_bytes=1000) == none - full - 1000
    assert full_recompute_peak_extra_bytes(shape, head_freed_bytes=10 * none) == 0


ISSUE_MODEL = dict(n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab_size=128)
ENGINE_CASES = [  # (id, model overrides, train overrides, rel bound); issue bound for activations is 15%
    ("full-recompute", {}, dict(recompute="full"), 0.01),  # issue config: was -19% (428,808 vs 346,380)
    ("full-recompute-big-vocab", dict(vocab_size=2048), dict(recompute="full"), 0.01),
    ("full-recompute-3-layers", dict(n_layers=3, d_model=48, n_heads=3), dict(recompute="full"), 0.01),
    ("bf16-autocast", {}, dict(precision="bf16-mixed"), 0.01),  # issue: was +87.5% / +13%
    ("fp16-autocast-gqa-big-vocab", dict(n_kv_heads=2, vocab_size=1000), dict(precision="fp16-mixed"), 0.01),
    ("bf16-autocast-selective", {}, dict(precision="bf16-mixed", recompute="selective"), 0.01),
    ("bf16-autocast-full-recompute", {}, dict(precision="bf16-mixed", recompute="full"), 0.15),
    ("bf16-autocast-full-recompute-3-layers", dict(n_layers=3), dict(precision="bf16-mixed", recompute="full"), 0.15),
    ("moe", dict(n_experts=4, top_k=2), {}, 0.01),  # issue: was +16%
    ("fp32", {}, {}, 0.01),
]


@pytest.mark.parametrize(("name", "model_kw", "train_kw", "rel"), ENGINE_CASES, ids=[c[0] for c in ENGINE_CASES])
@pytest.mark.heavy
def test_estimate_matches_engine_step_activation_peak(name, model_kw, train_kw, rel):
    """estimate()'s activations for a ddp rank vs the engine's measurement moment, 2 microbatches."""
    from backend.analytic.estimate import estimate
    from backend.spec import ExperimentSpec

    torch.manual_seed(0)
    spec = ExperimentSpec(model={**ISSUE_MODEL, **model_kw}, train={"global_batch": 4, "micro_batch": 2, **train_kw},
                          parallel={"strategy": "ddp", "world_size": 1})
    measured = engine_step_activation_peak(spec)
    predicted = estimate(spec).per_rank[0].activations_bytes
    assert predicted == pytest.approx(measured, rel=rel), (name, predicted, measured)


def test_autocast_saved_tensors_are_what_the_formula_counts():
    """saved_tensors_hooks under CPU bf16 autocast: fp32 residual/LayerNorm inputs, one 16-bit input copy per
    Linear (q, k, v cast the ln1 output separately), 16-bit weight copies saved by the matmuls."""
    from backend.analytic.layout import Layout, RankPosition
    from backend.analytic.memory.parts import rank_parts
    from backend.analytic.memory.rank_activations import autocast_casts
    from backend.spec import ExperimentSpec

    spec = ExperimentSpec(model=ISSUE_MODEL, train={"global_batch": 2, "micro_batch": 2, "precision": "bf16-mixed"},
                          parallel={"strategy": "ddp", "world_size": 1})
    model = build_model(spec.model, seed=0)
    blk = model.layers["0"]
    params = {p.untyped_storage().data_ptr() for p in blk.parameters()}
    seen: dict[int, tuple[int, torch.dtype, bool]] = {}

    def pack(ten):
        st = ten.untyped_storage()
        seen.setdefault(st.data_ptr(), (st.nbytes(), ten.dtype, st.data_ptr() in params))
        return ten

    x = torch.randn(2, 32, 64)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda z: z), torch.autocast("cpu", dtype=torch.bfloat16):
        blk(x)
    activations = sum(nb for nb, _, is_param in seen.values() if not is_param)
    layout = Layout.of(spec)
    w_blocks, _, _ = autocast_casts(spec.model, layout, rank_parts(spec.model, layout, RankPosition()))
    per_block = model_layer_activation_bytes(s=32, b=2, h=64, a=4, kv_heads=4, ffn=256, dtype_bytes=2, autocast=True)
    assert activations == per_block + w_blocks / spec.model.n_layers
    assert (sum(nb for nb, dt, p in seen.values() if dt == torch.float32 and not p)
            == 2 * 2 * 32 * 64 * 4 + 4 * 2 * 32 * 4)


TP_SAVED = program_job("tp_saved_tensors", 2)


@pytest.mark.slow
@uses(TP_SAVED)
def test_tp_sp_layer_formula_matches_saved_tensors(farm):
    """TP=2 (Megatron plan via parallelize_module), with and without SP: per-rank saved bytes of one block."""
    rows = farm.result(TP_SAVED)
    assert len(rows) == 4
    for row in rows:
        pred = model_layer_activation_bytes(s=32, b=2, h=64, a=4, kv_heads=row["kv"], ffn=256, dtype_bytes=4,
                                            t=row["t"], sp=row["sp"])
        assert pred == pytest.approx(row["bytes"], rel=TOL), row
