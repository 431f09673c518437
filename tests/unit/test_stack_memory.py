"""Memory per stack (issue 34 part 2): each term of memory/stack_states.py and memory/stack_activations.py against
the framework source's own arithmetic (research notes /work/wt/research/stacks.md Sec 1-5), the default stack
untouched, and the planner's vectorised path equal to estimate's on stack layouts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from backend.analytic.estimate import estimate, worst_rank_bytes
from backend.analytic.layout import Layout, RankPosition
from backend.analytic.memory.rank_memory import rank_memory, worst_rank_memory
from backend.analytic.memory.stack_activations import head_bytes
from backend.analytic.memory.stack_states import DEEPSPEED_REDUCE_BUCKET, megatron_buffer_numel
from backend.analytic.memory.te_block import TeLayer, te_layer_bytes
from backend.analytic.params import count_params
from backend.analytic.textbook.korthikanti import korthikanti_layer_bytes
from backend.planner.held import HeldTraining
from backend.planner.space import enumerate_layouts, light_spec
from backend.spec import ExperimentSpec

pytestmark = pytest.mark.unit

SMALL = {"vocab_size": 1024, "d_model": 256, "n_layers": 4, "n_heads": 8, "n_kv_heads": 2, "ffn_hidden": 640,
         "seq_len": 512, "norm": "rmsnorm", "mlp": "swiglu", "positions": "rope", "bias": "none", "attention": "flash",
         "tie_embeddings": False}


def _spec(train: dict, parallel: dict) -> ExperimentSpec:
    return ExperimentSpec.for_prediction({"model": SMALL, "train": {"global_batch": 8, "micro_batch": 1,
                                                                    "precision": "bf16-mixed", **train},
                                          "parallel": parallel, "runtime": {"device": "cpu"}})


def _rank(spec: ExperimentSpec, rank: int = 0):
    layout = Layout.of(spec)
    return layout, rank_memory(spec.model, layout, RankPosition.of_rank(spec, rank))


MEGATRON_CP = {"strategy": "zero1", "world_size": 8, "tp": 1, "pp": 1, "cp": 2}
SMALL_MODEL = _spec({}, {"strategy": "ddp", "world_size": 1}).model


def test_default_stack_has_no_stack_terms():
    spec = _spec({}, {"strategy": "zero1", "world_size": 2})
    assert Layout.of(spec).stack is None


def test_megatron_distributed_optimizer_is_2_4_12_over_dp_cp_with_megatron_padding():
    """Megatron dist_optimizer.md table (bf16 params + fp32 grads: 6 + 12/d) with d = dp x cp (intra_dp_cp_group),
    over the buffer Megatron pads: 64-element param starts, an end on a multiple of lcm(d, 128)."""
    spec = _spec({"stack": "megatron"}, MEGATRON_CP)
    layout, m = _rank(spec)
    d = 8
    p = count_params(spec.model)
    n = m.params_bytes // 2
    assert m.grads_bytes == 4 * n and m.optimizer_bytes == 12 * n // d
    assert n % math.lcm(d, 128) == 0 and p <= n < p + 64 * 40 + math.lcm(d, 128)
    # dp alone when the optimizer is not sharded over cp
    _, alone = _rank(_spec({"stack": "megatron", "optimizer_over_cp": False}, MEGATRON_CP))
    assert alone.optimizer_bytes == 12 * (alone.params_bytes // 2) // 4


def test_megatron_grad_reduce_in_bf16_halves_the_grad_buffer():
    _, m = _rank(_spec({"stack": "megatron", "grad_reduce_dtype": "bf16"}, MEGATRON_CP))
    assert m.grads_bytes == m.params_bytes


def test_megatron_fp8_params_are_the_weights_plus_their_transpose_and_no_workspace():
    """--fp8-param-gather: TE's linear weights are Float8Tensors (1 B in the uint8 buffer) used as they are, no cached
    workspace (TE quantize_weight: "Already-quantized weight"), plus their columnwise transpose (1 B on Hopper); every
    other param stays bf16. So 1 + 1 B per linear weight element and 2 B per other element: 2 B per buffer element,
    where it was 1 B per element + a 2 B workspace per linear weight element (22 GB instead of 16 GB for 8B)."""
    from backend.analytic.memory.parts import rank_parts

    train = {"stack": "megatron", "precision": "fp8", "grad_reduce_dtype": "bf16"}
    layout, fp8_params = _rank(_spec(train | {"param_dtype": "fp8"}, MEGATRON_CP))
    n = fp8_params.grads_bytes // 2
    assert fp8_params.params_bytes == 2 * n
    workspace_layout, workspace = _rank(_spec(train, MEGATRON_CP))
    linear = rank_parts(SMALL_MODEL, workspace_layout, RankPosition()).total("linear_weight_numel")
    assert workspace.params_bytes == 2 * n + 2 * linear and 0 < linear < n


def test_megatron_without_distributed_optimizer_is_18_bytes_unpadded():
    """Float16OptimizerWithFloat16Params: bf16 param 2 + fp32 main grad 4 + fp32 main param 4 + Adam 8."""
    spec = _spec({"stack": "megatron"}, {"strategy": "ddp", "world_size": 2})
    _, m = _rank(spec)
    p = count_params(spec.model)
    assert (m.params_bytes, m.grads_bytes, m.optimizer_bytes) == (2 * p, 4 * p, 12 * p)


def test_megatron_buffer_end_alignment():
    assert megatron_buffer_numel(1000, 8) == 1024
    assert megatron_buffer_numel(np.array([1000, 129]), np.array([3, 8])).tolist() == [1152, 256]


def test_torchtitan_fsdp2_keeps_fp32_shards_and_adam_without_master():
    """MixedPrecisionPolicy: sharded fp32 params and grads, AdamW on the shard (16/N B per param), no master."""
    spec = _spec({"stack": "torchtitan"}, {"strategy": "zero3", "world_size": 4})
    layout, m = _rank(spec)
    real = m.parts.total("real_numel")
    storage = m.parts.total("storage_numel")
    assert m.optimizer_bytes == 8 * real
    assert m.params_bytes == 4 * storage  # zero3 after the root's forward: nothing unsharded
    assert m.grads_bytes == 4 * storage


def test_torchtitan_zero1_shards_expert_state_over_the_expert_replicas_only():
    """zero1 x ep on stack torchtitan: the routed experts' AdamW state shards over the ranks holding the same experts
    (edp = dp / ep = 2), the dense state over dp = 8, as the engine's zero1 and Megatron's distributed optimizer do;
    it was divided by dp for the experts too (7x under on Mixtral-sized experts)."""
    moe = SMALL | {"n_experts": 8, "top_k": 2}
    spec = ExperimentSpec.for_prediction({"model": moe, "train": {"global_batch": 8, "micro_batch": 1,
                                                                  "precision": "bf16-mixed", "stack": "torchtitan"},
                                          "parallel": {"strategy": "zero1", "world_size": 8, "ep": 4},
                                          "runtime": {"device": "cpu"}})
    _, m = _rank(spec)
    experts, local = m.parts.total("ep_expert_numel"), m.parts.total("local_numel")
    assert experts > 0
    assert m.optimizer_bytes == pytest.approx(8 * ((local - experts) / 8 + experts / 2))


def test_torchtitan_zero2_unsharded_copy_is_bf16():
    spec = _spec({"stack": "torchtitan"}, {"strategy": "zero2", "world_size": 4})
    _, m = _rank(spec)
    storage, unsharded = m.parts.total("storage_numel"), m.parts.total("fsdp_unsharded_numel")
    assert m.params_bytes == 4 * storage + 2 * unsharded


@pytest.mark.parametrize("strategy,zero", [("ddp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3)])
def test_deepspeed_zero_stages(strategy, zero):
    """DeepSpeed bf16 (grad_accum_dtype = the model dtype): stage 0 2+2+12, stage 1 2+2+12/N, stage 2 2+2/N+12/N
    + one IPG bucket, stage 3 (2+2+12)/N + one IPG bucket (N = 4)."""
    spec = _spec({"stack": "deepspeed"}, {"strategy": strategy, "world_size": 4})
    _, m = _rank(spec)
    p = count_params(spec.model)
    flat = -(-p // 8) * 8
    shard = -(-p // 4)
    expect = {0: (2 * p, 2 * p, 12 * p), 1: (2 * flat, 2 * flat, 12 * flat // 4),
              2: (2 * flat, 2 * flat // 4 + 2 * DEEPSPEED_REDUCE_BUCKET, 12 * flat // 4),
              3: (2 * shard, 2 * shard + 2 * DEEPSPEED_REDUCE_BUCKET, 12 * shard)}[zero]
    assert (m.params_bytes, m.grads_bytes, m.optimizer_bytes) == expect


def test_te_layer_is_34h_per_token_for_llama_3_1_8b():
    """Research notes Sec 2.3: bf16 TE block of Llama-3.1-8B (h 4096, h_kv 1024, f 14336, SwiGLU) saves
    12h + 4h_kv + 6f = 139,264 B per token beyond the fp32 norm stats and the softmax stats; fp8: 11h + 4h_kv + 5f."""
    layer = TeLayer(s=4096, b=1, h=4096, q=4096, kv=1024, a=32, f=14336, gated=True, t=1, sp=False, norm_stats=1, c=2,
                    fp8=False)
    stats = 2 * 4 + 4 * 32
    assert te_layer_bytes(layer) == 4096 * (139_264 + stats)
    fp8 = TeLayer(**{**layer.__dict__, "fp8": True})
    assert te_layer_bytes(fp8) == 4096 * (11 * 4096 + 4 * 1024 + 5 * 14336 + stats)
    gpt = TeLayer(s=1, b=1, h=1024, q=1024, kv=1024, a=16, f=4096, gated=False, t=4, sp=True, norm_stats=2, c=2,
                  fp8=False)
    assert te_layer_bytes(gpt) == 32 * 1024 / 4 + (2 * 2 * 4) / 4 + 4 * 16 / 4  # Korthikanti's 34 sbh minus the masks


def test_unfused_attention_keeps_the_softmax_output_unless_core_attn_is_recomputed():
    """Megatron's unfused core attention (dot_product_attention.py 194-239) saves its softmax output, c B per score
    (a s per token / t), where FusedAttention saves 4 B of statistics per head; core_attn recompute drops either."""
    fused = TeLayer(s=512, b=1, h=1024, q=1024, kv=1024, a=16, f=4096, gated=False, t=4, sp=True, norm_stats=2, c=2,
                    fp8=False)
    unfused = TeLayer(**{**fused.__dict__, "fused_attention": False})
    assert te_layer_bytes(unfused) - te_layer_bytes(fused) == 512 * (2 * 16 * 512 - 4 * 16) / 4
    ck = {"modules": frozenset({"core_attn"})}
    assert te_layer_bytes(TeLayer(**{**unfused.__dict__, **ck})) == te_layer_bytes(TeLayer(**{**fused.__dict__, **ck}))


GPT_BLOCK = {"vocab_size": 1024, "d_model": 1024, "n_heads": 16, "seq_len": 512, "attention": "math"}


def _block_bytes(recompute: str) -> float:
    """One GPT block's saved bytes on the megatron stack with Megatron's own kernels (fused element-wise, unfused
    attention: the 2022 papers' code), tp 4 with SP: the activations of 4 blocks less those of 2, over 2."""
    def activations(layers: int) -> int:
        spec = ExperimentSpec.for_prediction({
            "model": {**GPT_BLOCK, "n_layers": layers},
            "train": {"global_batch": 1, "micro_batch": 1, "precision": "bf16-mixed", "recompute": recompute,
                      "stack": "megatron", "attention_kernel": "eager", "elementwise": "fused"},
            "parallel": {"strategy": "ddp", "world_size": 4, "tp": 4, "sequence_parallel": True},
            "runtime": {"device": "cpu"}})
        return estimate(spec).worst().activations_bytes

    return (activations(4) - activations(2)) / 2


@pytest.mark.parametrize("recompute", ["selective", "none"])
def test_megatrons_own_kernels_save_korthikanti_table2_less_its_dropout(recompute):
    """Korthikanti et al. 2022 Table 2 with SP: sbh/t (34 + 5as/h), selective sbh 34/t. Without dropout (the recipes'
    hidden and attention dropout 0) the two hidden masks (2 sbh/t), the attention mask and the dropped-out probabilities
    (3as/h sbh/t) are not saved; the fp32 LayerNorm statistics (2 norms x mu, rsigma) are. Was ShardLab's own eager
    block (60 sbh/t under selective: the 1T row of Table 5 did not fit its A100)."""
    s, h, a, t = 512, 1024, 16, 4
    sbh = s * h
    table2 = korthikanti_layer_bytes(s=s, b=1, h=h, a=a, t=t, sp=True, recompute=recompute)
    dropout = 2 * sbh / t + (3 * a * s / h * sbh / t if recompute == "none" else 0)
    stats = 2 * 2 * 4 * s / t
    assert _block_bytes(recompute) == pytest.approx(table2 - dropout + stats, rel=1e-12)


def test_loss_parallel_divides_logits_and_their_gradients_by_tp():
    tp = {"strategy": "tp", "world_size": 2, "tp": 2, "sequence_parallel": True}
    on, off = (_spec({"stack": "torchtitan", "loss_parallel": v}, tp) for v in (True, False))
    lon, loff = Layout.of(on), Layout.of(off)
    h_on, h_off = head_bytes(on.model, lon), head_bytes(off.model, loff)
    assert h_off.logits == 2 * h_on.logits == 512 * 1 * 1024
    _, m_on = _rank(on)
    _, m_off = _rank(off)
    # loss parallel's `_log_softmax` peaks at 2 + 4 + 8 B per (sharded) logit, the plain loss at 2 + 4 + 4
    assert m_off.activations_bytes - m_on.activations_bytes == (2 + 4 + 4) * h_off.logits - (2 + 4 + 8) * h_on.logits
    e_on, e_off = estimate(on).per_rank[0], estimate(off).per_rank[0]
    assert e_on.loss_backward_temp_bytes == 2 * h_on.logits  # loss parallel: 16 B at backward vs 14 B at forward
    assert e_off.loss_backward_temp_bytes == 2 * h_off.logits  # the plain loss: 12 B at backward vs 10 B at forward


def test_the_plain_losss_bytes_per_logit_are_what_torch_allocates():
    """torchtitan's loss, `cross_entropy(pred.float(), labels)` with the 16-bit logits deleted before backward
    (train.py: `del pred`), measured with MemTracker on the CPU (aten's log_softmax and nll_loss, as on CUDA): the
    forward peaks at the logits, their fp32 copy and the log-probs; the log-probs stay; the backward peaks at the
    log-probs, nll_loss's gradient and log_softmax's."""
    import torch
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker

    spec = _spec({"stack": "torchtitan"}, {"strategy": "zero3", "world_size": 2})
    head = head_bytes(spec.model, Layout.of(spec))
    n, vocab = 256, 4096
    x = torch.randn(n, 2, dtype=torch.bfloat16, requires_grad=True)  # an inner width of 2: inputs of ~0.02 B per logit
    w = torch.randn(2, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    tracker = MemTracker()
    with tracker:
        pred = x @ w
        loss = F.cross_entropy(pred.float(), labels)
        kept = tracker.get_tracker_snapshot("current")
        forward = tracker.get_tracker_snapshot("peak")
        del pred
        loss.backward()
    device = next(iter(kept))
    fixed = (x.numel() + w.numel()) * 2  # the inputs (their gradients come after the peak)
    per_logit = [(snap[device]["Total"] - fixed) / (n * vocab) for snap in (forward, kept)]
    backward = (tracker.get_tracker_snapshot("peak")[device]["Total"] - fixed) / (n * vocab)
    assert per_logit[0] == pytest.approx(head.forward_peak_per_logit, abs=0.05)
    assert per_logit[1] == pytest.approx(2 + head.kept_per_logit, abs=0.05)  # the logits still bound, then deleted
    assert backward == pytest.approx(head.backward_peak_per_logit, abs=0.05)


@pytest.mark.heavy
@pytest.mark.parametrize("compiled", [False, True])
def test_the_compiled_losss_bytes_per_logit_are_what_inductor_allocates(compiled):
    """torchtitan's loss as its train step runs it, eager and under torch.compile, measured by a fresh process's peak
    resident memory (tests/helpers/compiled_loss_memory.py). Compiled, nothing of 4 B per logit exists: the 16-bit
    logits are saved, the gradient is 16-bit (2, 2, 4 B); eager, 10, 4, 12."""
    import json
    import subprocess
    import sys

    from tests.helpers.launch import ROOT, rank_env

    spec = _spec({"stack": "torchtitan", "elementwise": "compiled", "loss_compiled": compiled},
                 {"strategy": "zero3", "world_size": 2})
    head = head_bytes(spec.model, Layout.of(spec))
    command = [sys.executable, "-m", "tests.helpers.compiled_loss_memory"] + (["--compiled"] if compiled else [])
    done = subprocess.run(command, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    per_logit = json.loads(done.stdout.strip().splitlines()[-1])
    assert per_logit == pytest.approx([head.forward_peak_per_logit, head.kept_per_logit,
                                       head.backward_peak_per_logit], abs=0.1)
    assert per_logit == pytest.approx([2, 2, 4] if compiled else [10, 4, 12], abs=0.1)


def test_torchtitan_compiles_the_loss_with_the_model_unless_told_not_to():
    """The stack default follows compile (torchtitan's CompileConfig.components ['model', 'loss']); an older run whose
    loss stayed eager (9dec370) says --no-compile-loss; under loss parallel the DTensor `_log_softmax` terms stay."""
    compiled = _spec({"stack": "torchtitan", "elementwise": "compiled"}, {"strategy": "zero3", "world_size": 2})
    eager = _spec({"stack": "torchtitan", "elementwise": "compiled", "loss_compiled": False},
                  {"strategy": "zero3", "world_size": 2})
    assert Layout.of(compiled).stack.loss_compiled and not Layout.of(eager).stack.loss_compiled
    assert not Layout.of(_spec({"stack": "torchtitan"}, {"strategy": "zero3", "world_size": 2})).stack.loss_compiled
    hc, he = head_bytes(compiled.model, Layout.of(compiled)), head_bytes(eager.model, Layout.of(eager))
    assert (hc.forward_peak_per_logit, hc.backward_peak_per_logit) == (2, 4)
    assert (he.forward_peak_per_logit, he.backward_peak_per_logit) == (10, 12)
    moments = [estimate(s).worst().moments() for s in (compiled, eager)]
    logits = hc.logits
    assert moments[1]["loss_backward"] - moments[0]["loss_backward"] == (12 - 4) * logits
    tp = {"strategy": "tp", "world_size": 2, "tp": 2, "sequence_parallel": True}
    parallel = _spec({"stack": "torchtitan", "elementwise": "compiled"}, tp)
    hp = head_bytes(parallel.model, Layout.of(parallel))
    assert (hp.forward_peak_per_logit, hp.backward_peak_per_logit) == (14, 16)


@pytest.mark.heavy
def test_a_compiled_op_sac_block_saves_what_backward_reads():
    """torchtitan compiles each op-SAC-wrapped block (apply_ac, then apply_compile). Measured with torch 2.13's
    Inductor on the CPU (saved_tensors_hooks on the compiled graph's saved tensors, parameters left out): the block
    keeps its input, the kept mm outputs but the last one (down feeds the residual add alone, so backward never reads
    it), and the attention output and log-sum-exp: the model's checkpoint unit for stack torchtitan, elementwise
    compiled, recompute op. Eager SAC caches every listed output as it runs (models/checkpointing.op_policy)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from backend.analytic.memory.stack_activations import block_terms
    from backend.models.checkpointing import op_policy, resolve_ops
    from backend.models.gpt import build_model
    from backend.recompute_policy import DEFAULT_SAC_OPS

    b = 2
    spec = _spec({"stack": "torchtitan", "elementwise": "compiled", "recompute": "op", "micro_batch": b},
                 {"strategy": "zero3", "world_size": 2})
    eager = _spec({"stack": "torchtitan", "recompute": "op", "micro_batch": b}, {"strategy": "zero3", "world_size": 2})
    m = spec.model
    block = build_model(m.model_copy(update={"n_layers": 1}), seed=0).to(torch.bfloat16).layers["0"]
    context = op_policy(resolve_ops(tuple(DEFAULT_SAC_OPS)))
    run = torch.compile(lambda x: checkpoint(block, x, use_reentrant=False, context_fn=context))
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    run(torch.randn(b, m.seq_len, m.d_model, dtype=torch.bfloat16, requires_grad=True)).sum().backward()
    saved: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(torch.randn(b, m.seq_len, m.d_model, dtype=torch.bfloat16, requires_grad=True))
    unit = block_terms(m, Layout.of(spec))[1]
    assert sum(saved.values()) == pytest.approx(unit, rel=1e-3)
    eager_unit = block_terms(eager.model, Layout.of(eager))[1]
    down = b * m.seq_len * m.d_model * 2
    assert eager_unit - unit == down


def test_megatron_cross_entropy_peaks_at_6_bytes_per_logit():
    spec = _spec({"stack": "megatron"}, {"strategy": "zero1", "world_size": 4, "tp": 2, "sequence_parallel": True})
    h = head_bytes(spec.model, Layout.of(spec))
    assert (h.forward_peak_per_logit, h.backward_peak_per_logit) == (6, 6)
    assert h.logits == 512 * 1024 / 2
    assert estimate(spec).per_rank[0].loss_backward_temp_bytes == 0


@pytest.mark.parametrize("stack", ["megatron", "torchtitan", "deepspeed"])
def test_planner_computes_estimates_number_on_stack_layouts(stack):
    """One model called by everything: the planner's worst-rank bytes on arrays of layouts equal worst_rank_bytes
    (estimate's core) on each planned spec alone."""
    spec = _spec({"stack": stack}, {"strategy": "ddp", "world_size": 8})
    held = HeldTraining.of_train(spec.train.model_dump(mode="json"))
    L = enumerate_layouts(spec.model, gpus=8, gpus_per_node=8, global_batch=8, precision="bf16-mixed")
    from dataclasses import replace
    L = replace(L, stack=held.stack_memory(spec.model, L.device))
    memory, _ = worst_rank_memory(spec.model, L)
    for i in range(0, len(L), max(1, len(L) // 25)):
        data = L.take(i).spec_dict(spec.model)
        data["train"].update(held.spec_train(data["train"]["recompute"]))
        one = light_spec(data)
        assert Layout.of(one).stack == L.stack
        assert worst_rank_bytes(one)[0] == pytest.approx(memory[i], rel=1e-12), data["name"]


def _published_spec(row_id: str, tmp_path) -> tuple[dict, str]:
    import json

    from backend.analytic.steptime.published_gpu import published_rows

    row = next(r for r in published_rows() if r.id == row_id)
    data = ExperimentSpec.for_prediction(row.spec).model_dump(mode="json")
    data["runtime"]["device"] = "cuda"
    path = tmp_path / f"{row_id}.json"
    path.write_text(json.dumps(data))
    return row, str(path)


def test_torchtitan_70b_recipe_through_the_cli_is_the_benchmarks_number(tmp_path, capsys):
    """Issue 34 done-when: `estimate --stack torchtitan --loss-parallel` on torchtitan's Llama-3-70B recipe (FSDP 32 x
    TP 8 + SP, local batch 16, seq 8192, full AC, float8) predicts at most the published 71.9 GiB peak reserved; the
    benchmark reads the same number through the same spec (no private knob)."""
    import json

    from backend.cli import main
    from benchmarks.published_gpu import memory_prediction

    row, path = _published_spec("titan-202412-t4-70b-2d", tmp_path)
    assert main(["estimate", "--spec", path, "--stack", "torchtitan", "--loss-parallel", "--hardware", row.hardware,
                 "--json", "--rank-limit", "1"]) == 0
    fit = json.loads(capsys.readouterr().out)["fit"]
    fullest_gib = fit["fullest_bytes"] / 2**30
    assert fullest_gib <= row.memory_gib
    assert fit["fits"] and fit["moment"] == "loss_backward"
    assert memory_prediction(row.spec, row.hardware)["fullest_gib"] == pytest.approx(fullest_gib, rel=1e-12)


def test_estimate_prints_the_fit_with_the_stacks_terms(tmp_path, capsys):
    from backend.cli import main

    row, path = _published_spec("nemo2407-h100-llama3-8b-g8", tmp_path)
    assert main(["estimate", "--spec", path, "--hardware", "h100-sxm", "--rank-limit", "1"]) == 0
    out = capsys.readouterr().out
    assert "fit on h100-sxm: rank 0 needs" in out and "fullest moment (activation_peak)" in out
