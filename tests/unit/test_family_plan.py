"""The planner on the 2026 MoE families (issue 24): EP layouts are searched with and without pipelining (ep | dp,
ep | n_experts, up to the number of experts; tp = 1: whole experts), predicted and marked prediction-only where this
engine cannot run them; `plan` returns EP layouts for DeepSeek-V3 on 512 H100s and gpt-oss-120b on 64 H100s.
(256 H100s until issue 32: at their fullest moment, inside backward, where FSDP2 / the pipeline keep every unit
unsharded with its accumulated gradients, DeepSeek-V3's EP layouts need more than an H100 on 256 GPUs; the plan's memory
used to be the activation peak alone.)"""

from __future__ import annotations

import numpy as np
import pytest

from backend.analytic.layout import Layout, RankPosition
from backend.analytic.memory.parts import rank_parts
from backend.analytic.memory.rank_activations import autocast_casts, rank_activation_bytes
from backend.analytic.steptime.hardware import get_hardware
from backend.planner.search import plan
from backend.planner.space import enumerate_layouts
from backend.presets import preset_model
from backend.spec import ExperimentSpec, ModelSpec, validate_spec
from backend.spec.checks import run_blockers


def _model(name: str, seq: int = 4096) -> ModelSpec:
    return ModelSpec(**(preset_model(name) | {"seq_len": seq}))


def test_ep_with_pipelining_and_with_tp_runs():
    """Issue 35: ep x pp (DeepSeek-V3's pp x ep x ZeRO-1 dp) and ep x tp (whole experts on every tp rank) run here."""
    data = {"model": {"n_experts": 4, "n_layers": 4},
            "parallel": {"strategy": "zero1", "world_size": 4, "ep": 2, "pp": 2}}
    spec, problems = validate_spec(data)
    assert problems == [] and run_blockers(spec) == []
    spec, problems = validate_spec(data | {"parallel": {"strategy": "zero3", "world_size": 4, "ep": 2, "tp": 2}})
    assert problems == [] and run_blockers(spec) == []


def test_the_ep_space_reaches_the_experts_and_pipelines():
    """DeepSeek-V3 on 256 GPUs: ep from 2 to 256 (= n_experts) without pipelining, and with pp (the published PP16 x
    EP64 layout's shape, DeepSeek-V3 report Sec 3.2, on 256 GPUs: pp 16 x ep 16), and with tp (issue 35: whole experts
    on every tp rank, ep | dp x cp)."""
    layouts = enumerate_layouts(_model("deepseek-v3"), gpus=256, gpus_per_node=8, global_batch=1024)
    ep, pp, tp, dp, cp = layouts.ep, layouts.pp, layouts.tp, layouts.dp, layouts.cp
    assert ep.max() == 256 and set(ep[pp == 1].tolist()) == {1, 2, 4, 8, 16, 32, 64, 128, 256}
    assert np.any((pp == 16) & (ep == 16)) and np.any((tp > 1) & (ep > 1))
    assert np.all((dp * cp) % ep == 0)


def test_zero3_ep256_activations_are_the_autocast_weight_casts():
    """The 40+ GB of activations of zero3 x ep256 with full recompute (DeepSeek-V3, s 4,096, b 1): this engine runs
    FSDP x EP under torch.autocast (no MixedPrecisionPolicy in a mix, strategies/data_parallel.py), whose cast cache
    keeps every Linear's 16-bit weight copy until the forward's autocast region exits, so every block's all-gathered
    weights outlive their reshard as bf16 copies: 2 B x 17.8 B Linear weights (61 blocks' unsharded non-expert weights
    + one local expert per MoE block) = 35.6 GB of the 46.9 GB. Right for this engine; Megatron / torchtitan cast
    through mixed-precision parameters instead. EP layouts fit with pipelining (next test). 46.95 GB since CUDA's fused
    RMSNorm keeps only the rstd (device.rms_norm_saved_bytes): the final norm's fp32 normalised x, s·h·4 =
    117,440,512 B, is gone (47.06 GB with device cpu)."""
    m = _model("deepseek-v3")
    spec = ExperimentSpec.for_prediction({"model": m.model_dump(),
                                          "train": {"precision": "bf16-mixed", "micro_batch": 1,
                                                                             "global_batch": 1024, "recompute": "full"},
                                          "parallel": {"strategy": "zero3", "world_size": 256, "ep": 256},
                                          "runtime": {"device": "cuda"}})
    layout = Layout.of(spec)
    parts = rank_parts(m, layout, RankPosition())
    weights, _, _ = autocast_casts(m, layout, parts)
    assert parts.total("linear_weight_numel") == pytest.approx(17.82e9, rel=1e-3)
    assert weights == 2 * parts.total("linear_weight_numel")
    assert rank_activation_bytes(m, layout, 0, parts) == pytest.approx(46.95e9, rel=1e-3)


@pytest.mark.parametrize("name,gpus,batch", [("deepseek-v3", 512, 1024), ("gpt-oss-120b", 64, 256)])
@pytest.mark.heavy
def test_plan_returns_ep_layouts(name, gpus, batch):
    # issue 35: EP x PP and zero1 x EP run here, so the default (runnable-only) plan offers EP layouts
    res = plan(_model(name), gpus=gpus, gpus_per_node=8, hw=get_hardware("h100-sxm"), global_batch=batch, top=10)
    with_ep = [c for c in res.configs if c["spec"]["parallel"]["ep"] > 1]
    assert with_ep and all(c["fits_exact"] and c["runnable"] for c in with_ep)
